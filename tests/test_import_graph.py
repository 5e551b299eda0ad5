"""The packages' import graph has no cycle, and layers only point down.

Floors, bottom up: ``core`` (what every app uses), ``metadata``, ``inference``, ``ops`` (operator
views of the whole platform), ``specops`` (the project shell: settings, urls, the Celery app,
asgi/wsgi). A module may import its own floor's package and the floors below it, never a floor
above (so nothing in ``metadata`` imports ``inference``, and nothing imports ``specops``).

Built from the source with ``ast`` (nothing is imported), over every ``.py`` file under the five
packages. An edge is any import statement anywhere in a
module: at module level, inside a function (a deferred import still ties the two modules
together), or under ``if TYPE_CHECKING:``. ``from X import Y`` is an edge to ``X.Y`` when ``Y``
is a submodule, else to ``X``; ``import X.Y`` is an edge to ``X.Y``. Imports of anything outside
the five packages are not edges.

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
