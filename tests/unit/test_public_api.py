"""The public API is what ``jobtier`` and ``jobtier.client`` export; nothing else is promised."""

from __future__ import annotations

import jobtier
import jobtier.client


def test_exports_resolve_and_are_sorted() -> None:
    for module in (jobtier, jobtier.client):
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert getattr(module, name) is not None, name


def test_the_pieces_a_user_needs_are_there() -> None:
    for name in ("Queue", "Worker", "Scheduler", "task", "JobContext", "Client", "AsyncClient",
                 "Settings", "JobStatus", "State", "Retry", "Fatal", "ScheduleSpec"):  # fmt: skip
        assert name in jobtier.__all__, name


def test_importing_the_client_loads_no_server_side_module() -> None:
    """``jobtier.client`` needs httpx only: no redis, asyncpg or starlette (the top-level
    package's names load on first use)."""
    import subprocess
    import sys

    code = (
        "import sys, jobtier.client, jobtier\n"
        "jobtier.Client, jobtier.JobSpec, jobtier.JobStatus\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('redis', 'hiredis', 'asyncpg', 'starlette', 'uvicorn', 'granian'))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_lazy_names_are_the_modules_own() -> None:
    from jobtier import worker
    from jobtier.worker import runner

    assert jobtier.Worker is runner.Worker
    assert set(jobtier.__all__) == {*jobtier._EXPORTS, "__version__"}
    assert worker is not None
