"""The layering holds: no import circle between jobtier's files or packages (every import
counts, one inside a function or under ``if TYPE_CHECKING:`` too), and each process loads
only what its part needs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import jobtier

SRC = Path(jobtier.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The jobtier modules ``source`` (module ``name``) imports, wherever the import
    statement stands."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{node.module}" if node.module else up
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # a module importing its own package's __init__ is no edge
            if target and target != name and not name.startswith(target + "."):
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {
        name: _imports(path.read_text(), name, path.name == "__init__.py", set(paths))
        for name, path in paths.items()
    }


def package_of(module: str) -> str:
    """``jobtier.engine.produce`` -> ``jobtier.engine``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_circle_between_files() -> None:
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_no_circle_between_packages() -> None:
    packages: dict[str, set[str]] = {}
    for name, deps in import_graph().items():
        if name == "jobtier":  # the public re-exports sit above everything
            continue
        own = package_of(name)
        packages.setdefault(own, set()).update(
            package_of(d) for d in deps if package_of(d) not in (own, "jobtier")
        )
    circle = find_circle(packages)
    assert circle is None, "package circle: " + " -> ".join(circle or [])


def test_the_graph_sees_every_kind_of_import() -> None:
    """A circle hidden behind a lazy import is still found: the graph is not blind to one."""
    modules = {"jobtier.a", "jobtier.b", "jobtier.c", "jobtier.d"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from jobtier.b import x\n"
        "def f():\n    import jobtier.c\n"
        "from . import d\n"
    )
    assert _imports(source, "jobtier.a", False, modules) == {"jobtier.b", "jobtier.c", "jobtier.d"}
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def _loaded(module: str) -> set[str]:
    """The modules a fresh interpreter has loaded once it imported ``module``."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout))


def _top(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


def test_the_client_loads_httpx_msgspec_and_the_core_only() -> None:
    loaded = _loaded("jobtier.client")
    assert not _top(loaded) & {"redis", "asyncpg", "hiredis", "croniter", "aiohttp", "starlette"}
    ours = {n for n in loaded if n.startswith("jobtier.")}
    assert ours and all(n.startswith(("jobtier.client", "jobtier.core")) for n in ours), ours


def test_a_worker_loads_neither_the_api_nor_the_persister_nor_aiohttp() -> None:
    loaded = _loaded("jobtier.worker.runner")
    assert "aiohttp" not in _top(loaded)
    assert not {n for n in loaded if n.startswith(("jobtier.api", "jobtier.persist.persister"))}


def test_the_api_loads_neither_the_worker_nor_the_roles_nor_aiohttp() -> None:
    loaded = _loaded("jobtier.api.app")
    assert not _top(loaded) & {"aiohttp", "croniter"}
    roles = ("jobtier.worker", "jobtier.persist.persister", "jobtier.webhooks.dispatcher")
    assert not {n for n in loaded if n.startswith(roles)}


def test_the_persister_loads_no_worker_and_no_api() -> None:
    loaded = _loaded("jobtier.persist.persister")
    assert not {n for n in loaded if n.startswith(("jobtier.worker", "jobtier.api"))}


def test_production_code_does_not_import_the_development_servers() -> None:
    for name, deps in import_graph().items():
        if not name.startswith(("jobtier.dev", "jobtier.testing", "jobtier.cli")):
            assert not {d for d in deps if d.startswith("jobtier.dev")}, name


def test_modules_fit_in_one_read_and_no_two_share_a_name() -> None:
    # the names Python gives a package's own files (``python -m jobtier``, ``-m jobtier.cli``)
    paths = [p for p in SRC.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    names = [p.name for p in paths]
    assert not {n for n in names if names.count(n) > 1}
    assert not {str(p.relative_to(SRC)) for p in paths if len(p.read_text().splitlines()) > 600}


def test_no_engine_class_over_25_methods() -> None:
    """The HTTP clients mirror the API, one method per operation: they are left out."""
    big = set()
    for path in SRC.rglob("*.py"):
        if path.parent.name in ("client", "dev"):  # the API's mirror; local servers for tests
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [
                    n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                if len(methods) > 25:
                    big.add(f"{path.relative_to(SRC)}:{node.name} ({len(methods)})")
    assert not big
