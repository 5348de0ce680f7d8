"""The documentation's code blocks that need a running jobtier (marked
``<!-- docs-test: server -->``, see tests/docs_blocks.py), run against ``jobtier run`` as a
reader runs them against ``make run``.

What stands in for the reader's set-up: ``make run`` is this test's ``jobtier run`` (a line
``make run`` is dropped), and the ``export JOBTIER_URL=…`` line it prints is the environment
the block runs in (``JOBTIER_URL``, ``JOBTIER_KEY``, ``JOBTIER_ADMIN_KEY``, and ``AUTH`` as
the tour sets it); the ports of ``make run`` (API 8000, Redis 16379, Postgres 15432) are the
run's; the placeholder job id ``01M8…-7`` is a real job (a demo ``sleep`` of one second). The
run's worker has the demo tasks and the tasks the pages' flows name (``fetch``, ``merge``,
``publish``). A backgrounded ``jobtier worker`` is waited for until it is live, and stopped
at the end.

A python block runs with that environment too (its ``os.environ``), as the reader's does after
the exports. An ``sh`` block runs in bash with ``-e``
and ``pipefail``; every HTTP answer ``curl`` gets is recorded, and a 5xx, a 401, a 404, a
405 or no answer fails the block (a 409 or 422 may be what the page shows).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest

from jobtier.dev.local_postgres import LocalPostgres
from tests.docs_blocks import PLACEHOLDER_ID, Block, all_blocks
from tests.e2e.jobtier_run import JobtierRun, copy_pg_template, wait_until

SERVER_BLOCKS = [b for b in all_blocks() if b.mode == "server"]

TASKS = """
from jobtier.demo import *  # noqa: F403  (echo, sleep, fail, cpu)
from jobtier import task


@task
async def fetch(ctx, payload):
    return {"page": payload["page"], "rows": 10}


@task
async def merge(ctx, payload):
    return {"rows": sum(d.result["rows"] for d in ctx.dependencies.values() if d.result)}


@task
async def publish(ctx, payload):
    return {"published": ctx.previous}
"""

PRELUDE = """
set -e -o pipefail
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
curl() { command curl -w '\\n@status=%{http_code}\\n' "$@"; }
_docs_workers() {
  command curl -s "$JOBTIER_URL/v1/admin/workers" -H "Authorization: Bearer $JOBTIER_ADMIN_KEY" \\
    | grep -o '"pid":' | wc -l
}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobtierRun]:
    """One ``jobtier run`` for the module, its worker running the pages' tasks."""
    folder = Path(tempfile.mkdtemp(prefix="jobtier-docs-"))  # not tmp_path: Postgres's user
    folder.chmod(0o755)
    template = folder / "template"
    LocalPostgres(template / "pg").start().stop()  # initdb, role and database
    copy_pg_template(template / "pg", folder / ".data")
    modules = tmp_path_factory.mktemp("tasks")
    (modules / "docs_tasks.py").write_text(TASKS)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(modules), saved]))
    try:
        started = JobtierRun(
            folder / ".data", folder / "run.log", "--tasks", "docs_tasks", "--grace", "1"
        )
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        started.wait_ready()  # its worker has advertised the pages' tasks by then
        yield started
    finally:
        started.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _local(code: str, run: JobtierRun) -> str:
    """The block with ``make run``'s addresses replaced by the run's."""
    return (
        code.replace("http://127.0.0.1:8000", run.base)
        .replace("127.0.0.1:16379", f"127.0.0.1:{run.redis_port}")
        .replace("127.0.0.1:15432", f"127.0.0.1:{run.pg_port}")
    )


def run_database_url(run: JobtierRun) -> str:
    """The Postgres of the run, as `jobtier run` names it to its parts."""
    return f"postgresql://jobtier@127.0.0.1:{run.pg_port}/jobtier"


def _job(run: JobtierRun) -> str:
    tenant, _ = run.keys()
    reply = httpx.post(
        f"{run.base}/v1/jobs",
        json={"type": "sleep", "payload": {"seconds": 1}},
        headers={"authorization": f"Bearer {tenant}"},
    )
    assert reply.status_code == 202, reply.text
    return str(reply.json()["id"])


def _script(block: Block, run: JobtierRun, job_id: str) -> str:
    lines = []
    for line in _local(block.code, run).replace(PLACEHOLDER_ID, job_id).splitlines():
        stripped = line.strip()
        if stripped.startswith(("make run", "export JOBTIER_URL=")):
            continue  # the run stands for `make run`; the environment for its exports
        background = re.match(r"^(\S*jobtier worker .*)&(\s*#.*)?$", stripped)
        if background:
            lines += [
                "_docs_n=$(_docs_workers)",
                line,
                'until [ "$(_docs_workers)" -gt "$_docs_n" ]; do sleep 0.2; done',
            ]
            continue
        lines.append(line)
    return PRELUDE + "\n".join(lines) + "\n"


def _run_sh(block: Block, run: JobtierRun, tmp_path: Path) -> None:
    tenant, admin = run.keys()
    bin_dir = Path(sys.executable).parent
    (tmp_path / ".venv").symlink_to(bin_dir.parent)  # the tour's `.venv/bin/jobtier`
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
    env |= {
        "JOBTIER_URL": run.base,
        "JOBTIER_KEY": tenant,
        "JOBTIER_ADMIN_KEY": admin,
        "AUTH": f"Authorization: Bearer {tenant}",
        "JOBTIER_REDIS_URL": f"redis://127.0.0.1:{run.redis_port}/0",
        "JOBTIER_DATABASE_URL": run_database_url(run),
        "PATH": os.pathsep.join([str(bin_dir), env.get("PATH", "")]),
    }
    script = _script(block, run, _job(run))
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    where = f"{block.where}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    assert done.returncode == 0, where
    statuses = [int(s) for s in re.findall(r"@status=(\d+)", done.stdout)]
    assert statuses or "curl" not in block.code, where
    bad = [s for s in statuses if s >= 500 or s in (0, 401, 404, 405)]
    assert not bad, f"answers {bad}: {where}"


def _run_python(block: Block, run: JobtierRun) -> None:
    tenant, admin = run.keys()
    namespace: dict[str, Any] = {"__name__": "docs_server_block"}
    code = compile(
        _local(block.code, run), block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    )
    if "client." in block.code and "Client(" not in block.code:
        from jobtier import Client

        namespace["client"] = Client(run.base, tenant)
    exports = {"JOBTIER_URL": run.base, "JOBTIER_KEY": tenant, "JOBTIER_ADMIN_KEY": admin}
    try:
        with mock.patch.dict(os.environ, exports):
            result = eval(code, namespace)
            if inspect.iscoroutine(result):
                asyncio.run(result)
    finally:
        if "client" in namespace and hasattr(namespace["client"], "close"):
            namespace["client"].close()


def test_there_are_server_blocks() -> None:
    assert {b.page for b in SERVER_BLOCKS} >= {"docs/client.md", "docs/getting-started.md"}


@pytest.mark.slow
@pytest.mark.parametrize("block", SERVER_BLOCKS, ids=lambda b: b.where)
def test_server_block_runs(block: Block, run: JobtierRun, tmp_path: Path) -> None:
    if block.lang == "sh":
        _run_sh(block, run, tmp_path)
    else:
        _run_python(block, run)
    wait_until(lambda: run.proc.poll() is None, "jobtier run still running", timeout=1)
