"""jobtier.testing's names, and what importing its pytest plugin costs (nothing heavy)."""

from __future__ import annotations

import subprocess
import sys

import jobtier.testing


def test_exports_resolve_and_are_sorted() -> None:
    assert jobtier.testing.__all__ == sorted(jobtier.testing.__all__)
    assert set(jobtier.testing.__all__) == set(jobtier.testing._EXPORTS)
    for name in jobtier.testing.__all__:
        assert getattr(jobtier.testing, name) is not None, name


def test_the_plugin_module_imports_no_engine_and_no_redis() -> None:
    """pytest imports the plugin in every session of every project that installs jobtier:
    it must not pull in Redis, the worker or the servers' code until a fixture is used."""
    code = (
        "import sys, jobtier.testing.plugin\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('jobtier', 'redis', 'hiredis', 'msgspec', 'asyncpg', 'starlette'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "jobtier,jobtier.testing,jobtier.testing.plugin"


def test_the_plugin_is_registered_as_a_pytest_entry_point() -> None:
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="pytest11") if e.name == "jobtier"]
    assert entry.value == "jobtier.testing.plugin"
