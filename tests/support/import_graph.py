"""The import graph of ``src/``, read from the sources (never importing them): which
module imports which, and the cycles in it. Every import counts, also one inside a
function, which runs only when called but still ties the two modules together; ``if
TYPE_CHECKING:`` blocks do not (they never run). ``from package import name`` depends
on ``package.name`` when that is a module, else on the package. A package's
``lazy_exports(globals(), {module: names})`` (``runplan.lazy_exports``) depends on each
module it names, as an import inside a function would."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("runplan", "runtime_core", "runtime_sim", "runtime_cupy")
#: What each package may import of the others.
ALLOWED = {
    "runplan": set(),
    "runtime_core": {"runplan"},
    "runtime_sim": {"runplan", "runtime_core"},
    "runtime_cupy": {"runplan", "runtime_core"},
}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the packages: its file and whether it is a package's ``__init__``."""
    found = {}
    for package in PACKAGES:
        for path in (SRC / package).rglob("*.py"):
            parts = list(path.relative_to(SRC).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found[".".join(parts)] = (path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements in ``node`` and below it, but those that only a type
    checker runs."""
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for other in node.orelse:
            yield from _imports(other)
        return
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    for child in ast.iter_child_nodes(node):
        yield from _imports(child)


def _lazy_modules(tree: ast.AST) -> Iterator[str]:
    """The modules that ``lazy_exports(namespace, {module: names})`` calls name."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("lazy_exports", "_lazy_exports")
            and len(node.args) == 2
            and isinstance(node.args[1], ast.Dict)
        ):
            for key in node.args[1].keys:
                assert isinstance(key, ast.Constant) and isinstance(key.value, str), key
                yield key.value


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``src/`` it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        deps: set[str] = set(_lazy_modules(tree))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                member = f"{source}.{alias.name}"
                deps.add(member if member in modules else source)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm),
    each as a closed path through its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path(graph, component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle through the component's first module, found breadth first."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")


def component(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules that reach ``start`` and that ``start`` reaches."""

    def reach(edges: dict[str, set[str]]) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in edges[todo.pop()]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    reverse: dict[str, set[str]] = {v: set() for v in graph}
    for v, ws in graph.items():
        for w in ws:
            reverse[w].add(v)
    return reach(graph) & reach(reverse)
