"""``django.setup()`` leaves torch and transformers unimported (issue 44).

torch and transformers are ~5 s of every process's start on the 2-core machine. A process that
never tokenizes or runs a model (``manage.py shell``, the suite's subprocesses) must not load them:
one module-level import on an app's ``ready()``, an ``admin.py`` or the registry's path brings
them back. (The URL conf, which the system checks load, still imports them through the API's
serializers.) The web process loads them on purpose, before it serves (``specops/asgi.py``).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import inference.engine

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers")

# django.setup() runs every app's ready() and the admin's autodiscovery (every admin.py); then the
# modules a Django process reaches for a version's files and its tokenizer, and the engine's front door.
START = """
import json, sys
import django
django.setup()
import inference.admin, inference.registry, inference.served_targets, inference.tokenizers
import inference.version_files, inference.engine, inference.engine.config, inference.engine.model_files
print(json.dumps(sorted(name for name in {heavy!r} if name in sys.modules)))
"""


def test_a_django_start_imports_neither_torch_nor_transformers():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "specops.settings"}
    result = subprocess.run([sys.executable, "-c", START.format(heavy=HEAVY)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == [], (f"a Django start imported {loaded}: find the chain with "
                          "`python -X importtime -c 'import django; django.setup()'`")


def test_the_engine_front_door_declares_what_it_loads_lazily():
    """Each name ``inference.engine`` re-exports is imported under TYPE_CHECKING from the module
    its table loads it from, so tests/test_import_graph.py sees the same edges the names follow."""
    path = ROOT / "inference" / "engine" / "__init__.py"
    declared = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            declared |= {(child.module, alias.name) for child in node.body if isinstance(child, ast.ImportFrom)
                         for alias in child.names}
    table = {(module, name) for module, names in inference.engine._MODULES.items() for name in names}
    assert declared == table
    assert sorted(inference.engine.__all__) == sorted(name for _, name in table)
