"""The packages' import graph has no cycle, and layers only point down, by import and by string.

Floors, bottom up: ``core`` (what every app uses), ``metadata`` (the store), ``sessions`` (a
session's life: submission, runs, its end, its cached state and stream), ``inference`` (serving:
the worker, the engine, the OpenAI protocol), ``ops`` (operator views of the whole platform),
``specops`` (the project shell: settings, urls, the Celery app, asgi/wsgi). A module may depend on
its own floor's package and the floors below it, never a floor above (so nothing in ``metadata``
imports ``sessions`` or ``inference``, and nothing imports ``specops``).

Built from the source with ``ast`` (nothing is imported), over every ``.py`` file under the six
packages. An edge is any import statement anywhere in a
module: at module level, inside a function (a deferred import still ties the two modules
together), or under ``if TYPE_CHECKING:``. ``from X import Y`` is an edge to ``X.Y`` when ``Y``
is a submodule, else to ``X``; ``import X.Y`` is an edge to ``X.Y``. Imports of anything outside
the six packages are not edges.

Dependencies by string, which no import shows, are read too (`string_dependencies`): a model
named by its label (``ForeignKey("app.Model")``, ``apps.get_model("app", "Model")``), a
migration's ``dependencies`` and ``run_before`` on another app's migrations, and a task
registered or sent by name (``shared_task(name=...)``, a beat job's ``PeriodicJob(name, task)``,
``task=``, ``send_task``/``signature``). Each names a package by its first dotted part (an app
label is mapped to its package: ``specops_sessions`` is ``sessions``), and must point down too.

Nothing is excluded: migrations and the shim modules kept for them
(``metadata/migration_operations.py``, ``metadata/schedule.py``) are part of no cycle, so they
are checked like any other module.
"""
from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("core", "metadata", "sessions", "inference", "ops", "specops")  # bottom up
APPS = FLOORS

# module -> {imported module: line of the first import statement that makes the edge}
Graph = dict[str, dict[str, int]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def app_modules(root: Path, apps: Iterable[str]) -> dict[str, Path]:
    return {module_name(path, root): path for app in apps for path in sorted((root / app).rglob("*.py"))}


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its nearest enclosing module that is one of ``modules``."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              modules: dict[str, Path]) -> Iterable[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _known(alias.name, modules)
            if target:
                yield target
        return
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        target = submodule if submodule in modules else _known(base, modules)
        if target:
            yield target


def import_graph(modules: dict[str, Path]) -> Graph:
    graph: Graph = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, module, path.name == "__init__.py", modules):
                    if target != module:
                        edges.setdefault(target, node.lineno)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's algorithm, iterative; only components of two or more modules (a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, {})))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def one_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    members, start = set(component), component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if successor in members and successor not in previous:
                    previous[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{component} is not a cycle")


def describe(graph: Graph, modules: dict[str, Path], cycle: list[str]) -> str:
    steps = [f"{a} -> {b} ({modules[a].relative_to(ROOT)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return "\n    ".join(steps)


def test_the_apps_have_no_import_cycle():
    modules = app_modules(ROOT, APPS)
    graph = import_graph(modules)
    assert graph["metadata.cache.two_tier"].keys() >= {"metadata.cache.invalidation", "metadata.replicas.lsn"}
    cycles = [one_cycle(graph, component) for component in strongly_connected(graph)]
    report = "\n".join(f"cycle: {' -> '.join(cycle)}\n    {describe(graph, modules, cycle)}" for cycle in cycles)
    print(report)
    assert not cycles, f"{len(cycles)} import cycle(s):\n{report}"


def test_metadata_imports_nothing_from_inference():
    modules = app_modules(ROOT, APPS)
    graph = import_graph(modules)
    arrows = sorted(
        f"{module} -> {target} ({modules[module].relative_to(ROOT)}:{line})"
        for module, edges in graph.items() if module.split(".")[0] == "metadata"
        for target, line in edges.items() if target.split(".")[0] == "inference"
    )
    print("\n".join(arrows))
    assert not arrows, "metadata must not import inference:\n" + "\n".join(arrows)


def test_the_graph_sees_deferred_relative_and_submodule_imports(tmp_path):
    """The checker itself: a cycle closed only by a function-level import is found."""
    files = {
        "app/__init__.py": "",
        "app/a.py": "from app import b\n",  # b is a submodule: an edge to app.b, not to app
        "app/b.py": "def later():\n    from .c import thing\n",  # relative, inside a function
        "app/c.py": "import app.a as first\nthing = 1\n",
        "app/d.py": "import os\nfrom app import c\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = app_modules(tmp_path, ["app"])
    graph = import_graph(modules)
    assert graph == {"app": {}, "app.a": {"app.b": 1}, "app.b": {"app.c": 2}, "app.c": {"app.a": 1},
                     "app.d": {"app.c": 2}}
    [component] = strongly_connected(graph)
    assert component == ["app.a", "app.b", "app.c"]
    assert one_cycle(graph, component) == ["app.a", "app.b", "app.c", "app.a"]


def test_layers_only_point_down():
    modules = app_modules(ROOT, APPS)
    graph = import_graph(modules)
    floor = {name: level for level, name in enumerate(FLOORS)}
    arrows = sorted(
        f"{module} -> {target} ({modules[module].relative_to(ROOT)}:{line})"
        for module, edges in graph.items()
        for target, line in edges.items()
        if floor[target.split(".")[0]] > floor[module.split(".")[0]]
    )
    print("\n".join(arrows))
    assert not arrows, "imports that run up a floor:\n" + "\n".join(arrows)


def test_the_floor_check_sees_an_upward_import(tmp_path):
    """The checker itself: core importing metadata inside a function is an upward arrow."""
    for name, text in {"core/__init__.py": "", "core/a.py": "def later():\n    from metadata import b\n",
                       "metadata/__init__.py": "", "metadata/b.py": "import core.a\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(app_modules(tmp_path, ["core", "metadata"]))
    assert graph["core.a"] == {"metadata.b": 2} and graph["metadata.b"] == {"core.a": 1}


# -- dependencies by string -------------------------------------------------------------------

MODEL_FIELDS = {"ForeignKey", "OneToOneField", "ManyToManyField", "ForeignObject"}
TASK_DECORATORS = {"shared_task", "task"}  # @shared_task(name=...), @app.task(name=...)
TASK_SENDERS = {"send_task", "signature"}  # app.send_task("name"), celery.signature("name")
MIGRATION_LINKS = {"dependencies", "run_before"}


def app_labels(root: Path, apps: Iterable[str]) -> dict[str, str]:
    """Each app's Django label -> its package: its ``AppConfig.label`` where ``apps.py`` sets one."""
    labels = {app: app for app in apps}
    for app in apps:
        config = root / app / "apps.py"
        if not config.exists():
            continue
        for node in ast.walk(ast.parse(config.read_text())):
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "label" for t in node.targets)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                labels[node.value.value] = app
    return labels


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _constants(tree: ast.Module) -> dict[str, str]:
    """The module's top-level ``NAME = "text"`` constants, so a name passed for a string is read."""
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def _text(node: ast.expr | None, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _named_by_string(tree: ast.Module) -> Iterable[tuple[str, int, str]]:
    """(dotted or label-first name, line, kind) of every model, migration and task named by string."""
    constants = _constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in MIGRATION_LINKS
                                                for t in node.targets):
            for item in getattr(node.value, "elts", []):
                if isinstance(item, ast.Tuple) and item.elts:
                    label = _text(item.elts[0], constants)
                    if label:
                        yield f"{label}.{_text(item.elts[1], constants) if len(item.elts) > 1 else ''}", node.lineno, "migration"
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if name in MODEL_FIELDS:
            model = _text(node.args[0] if node.args else _keyword(node, "to"), constants)
            if model and "." in model:
                yield model, node.lineno, "model"
        elif name == "get_model" and node.args:
            first = _text(node.args[0], constants)
            second = _text(node.args[1], constants) if len(node.args) > 1 else None
            if first:
                yield (f"{first}.{second}" if second else first), node.lineno, "model"
        elif name in TASK_DECORATORS:
            task = _text(_keyword(node, "name"), constants)
            if task:
                yield task, node.lineno, "task"
        elif name in TASK_SENDERS and node.args:
            task = _text(node.args[0], constants)
            if task:
                yield task, node.lineno, "task"
        elif name == "PeriodicJob":
            task = _text(node.args[1] if len(node.args) > 1 else _keyword(node, "task"), constants)
            if task:
                yield task, node.lineno, "task"
        else:
            task = _text(_keyword(node, "task"), constants)
            if task:
                yield task, node.lineno, "task"


def string_dependencies(modules: dict[str, Path], labels: dict[str, str]) -> list[tuple[str, str, int, str]]:
    """(module, package it names, line, kind) of each reference by string into the packages."""
    found = []
    for module, path in modules.items():
        for text, line, kind in _named_by_string(ast.parse(path.read_text(), filename=str(path))):
            package = labels.get(text.split(".")[0])
            if package is not None:
                found.append((module, package, line, f"{kind} {text!r}"))
    return found


def test_string_dependencies_only_point_down():
    modules = app_modules(ROOT, APPS)
    found = string_dependencies(modules, app_labels(ROOT, APPS))
    kinds = {what.split()[0] for _, _, _, what in found}
    assert kinds == {"model", "migration", "task"}, f"the checker found no {{'model', 'migration', 'task'}} - {kinds}"
    floor = {name: level for level, name in enumerate(FLOORS)}
    arrows = sorted(f"{module} -> {package} by {what} ({modules[module].relative_to(ROOT)}:{line})"
                    for module, package, line, what in found if floor[package] > floor[module.split(".")[0]])
    print("\n".join(arrows))
    assert not arrows, "dependencies by string that run up a floor:\n" + "\n".join(arrows)


def test_the_string_check_sees_models_migrations_and_tasks(tmp_path):
    """The checker itself: a model, a migration and a task named by string, an app label mapped."""
    files = {
        "core/__init__.py": "",
        "core/models.py": 'from django.db import models\n'
                          'class A(models.Model):\n'
                          '    b = models.ForeignKey("metadata.B", on_delete=models.CASCADE)\n'
                          '    s = models.ForeignKey(to="specops_sessions.S", on_delete=models.CASCADE)\n'
                          '    me = models.ForeignKey("self", on_delete=models.CASCADE)\n',
        "metadata/__init__.py": "",
        "metadata/migrations/__init__.py": "",
        "metadata/migrations/0002_x.py": 'class Migration:\n'
                                         '    dependencies = [("metadata", "0001_initial"), ("ops", "0001_initial"),\n'
                                         '                    ("django_celery_beat", "0019_x")]\n',
        "metadata/jobs.py": 'TASK = "ops.tasks.roll_up"\n'
                            'def jobs():\n'
                            '    return [PeriodicJob("roll up", TASK, 1), PeriodicJob("rotate", "metadata.tasks.rotate", 1)]\n'
                            'def rollups(apps):\n'
                            '    return apps.get_model("ops", "OpsRollup")\n',
        "sessions/__init__.py": "",
        "sessions/apps.py": 'class SessionsConfig:\n    name = "sessions"\n    label = "specops_sessions"\n',
        "sessions/tasks.py": '@shared_task(name="sessions.generate")\ndef generate(): ...\n'
                             'def send(app):\n    app.send_task("inference.replay")\n',
        "inference/__init__.py": "",
        "ops/__init__.py": "",
        "ops/migrations/__init__.py": "",
        "ops/migrations/0001_initial.py": 'class Migration:\n    run_before = [("metadata", "0002_x")]\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    apps = ["core", "metadata", "sessions", "inference", "ops"]
    labels = app_labels(tmp_path, apps)
    assert labels == {"core": "core", "metadata": "metadata", "sessions": "sessions", "inference": "inference",
                      "ops": "ops", "specops_sessions": "sessions"}
    found = sorted(string_dependencies(app_modules(tmp_path, apps), labels))
    assert found == [
        ("core.models", "metadata", 3, "model 'metadata.B'"),
        ("core.models", "sessions", 4, "model 'specops_sessions.S'"),
        ("metadata.jobs", "metadata", 3, "task 'metadata.tasks.rotate'"),
        ("metadata.jobs", "ops", 3, "task 'ops.tasks.roll_up'"),
        ("metadata.jobs", "ops", 5, "model 'ops.OpsRollup'"),
        ("metadata.migrations.0002_x", "metadata", 2, "migration 'metadata.0001_initial'"),
        ("metadata.migrations.0002_x", "ops", 2, "migration 'ops.0001_initial'"),
        ("ops.migrations.0001_initial", "metadata", 2, "migration 'metadata.0002_x'"),
        ("sessions.tasks", "inference", 4, "task 'inference.replay'"),
        ("sessions.tasks", "sessions", 1, "task 'sessions.generate'"),
    ]
