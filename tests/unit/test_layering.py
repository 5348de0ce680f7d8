"""The layering holds: no import circle among jobtier's modules, and the light parts stay light."""

from __future__ import annotations

import ast
from pathlib import Path

import jobtier

SRC = Path(jobtier.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """jobtier modules imported when ``path`` is imported: module-level statements only (an
    ``if TYPE_CHECKING:`` block and imports inside functions run later, if ever)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: _top_level_imports(path, set(paths)) for name, path in paths.items()}


def test_no_import_circle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circle = [*stack[stack.index(dep) :], dep]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_graph_sees_real_edges() -> None:
    graph = import_graph()
    assert "jobtier.engine.produce" in graph["jobtier.engine.queue"]
    assert "jobtier.metrics.histogram" in graph["jobtier.worker.state"]


def test_production_code_does_not_import_the_development_servers() -> None:
    graph = import_graph()
    for name, deps in graph.items():
        if not name.startswith("jobtier.dev") and name != "jobtier.testing":
            assert not {d for d in deps if d.startswith("jobtier.dev")}, name
