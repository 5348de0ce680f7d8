"""jobtier.testing against the real thing.

In this process: the plugin's fixtures (``jobtier_queue``, ``jobtier_worker``) run a real
worker over a real Redis, and for each kind of outcome the job ends as ``run_task`` said it
would (the same code decides in both; Redis's part, fail.lua and stopped.lua, is checked
here against the rule ``run_task`` states).

In subprocesses (a user's project in a temporary folder, the plugin loaded from its entry
point): the fixtures work, the server is shared by the session and emptied per test, it is
stopped on every exit path (checked by pid), loading the plugin starts and imports nothing,
a missing redis-server is a skip with the way to install it, and examples/ passes.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.errors import Cancelled, Fatal, Retry
from jobtier.core.model import JobStatus
from jobtier.engine.queue import Queue
from jobtier.testing import BurstWorker, Outcome, run_task
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import Task, TaskRegistry, task
from tests.fixtures.engine import wait_for

ROOT = Path(__file__).resolve().parents[2]
RESULT_LIMIT = 200

# --- the same outcome from a real worker and from run_task ------------------------------------


class Permanent(Exception):
    pass


@task(retries=2)
async def ok(ctx: JobContext, payload: Any) -> Any:
    ctx.progress(1)
    ctx.progress({"last": True})
    return {"got": payload, "attempt": ctx.attempt}


@task(retries=2)
def ok_sync(ctx: JobContext, payload: Any) -> Any:
    ctx.progress("from a thread")
    return [payload, ctx.max_attempts]


@task(retries=2, backoff_base=0.5, backoff_factor=2.0, jitter=0.0)
async def boom(ctx: JobContext, payload: Any) -> None:
    raise RuntimeError(f"attempt {ctx.attempt} of {ctx.max_attempts} fails")


@task(retries=4)
async def fatal(ctx: JobContext, payload: Any) -> None:
    raise Fatal("cannot be fixed")


@task(retries=4, non_retryable=[Permanent])
async def permanent(ctx: JobContext, payload: Any) -> None:
    raise Permanent("never works")


@task(retries=2, backoff_base=60.0)
async def retry_later(ctx: JobContext, payload: Any) -> None:
    raise Retry("not yet", delay=0.3)


@task(retries=2, timeout=0.05, jitter=0.0)  # no jitter: the delays compare exactly
async def too_slow(ctx: JobContext, payload: Any) -> None:
    await asyncio.Event().wait()


@task(retries=2)
async def too_big(ctx: JobContext, payload: Any) -> str:
    return "x" * RESULT_LIMIT


@task(retries=2)
async def not_json(ctx: JobContext, payload: Any) -> Any:
    return {"when": object()}


@task(retries=2)
async def confused(ctx: JobContext, payload: Any) -> None:
    raise Cancelled("raised with no cancel requested")


@task(retries=2)
async def until_cancelled(ctx: JobContext, payload: Any) -> None:
    for i in range(100_000):  # progress makes the worker beat, and so see the cancel
        ctx.progress(i)
        await asyncio.sleep(0.01)


@task(retries=2)
def until_cancelled_sync(ctx: JobContext, payload: Any) -> None:
    for i in range(100_000):
        ctx.progress(i)
        ctx.check_cancelled()
        time.sleep(0.01)


TASKS = TaskRegistry(
    [ok, ok_sync, boom, fatal, permanent, retry_later, too_slow, too_big, not_json, confused,
     until_cancelled, until_cancelled_sync]
)  # fmt: skip


@pytest.fixture
def jobtier_tasks() -> TaskRegistry:
    return TASKS


@pytest.fixture
def jobtier_settings(jobtier_settings: Settings) -> Settings:
    return jobtier_settings.replace(max_result_bytes=RESULT_LIMIT)


EXPECTED_JOB_STATE = {
    "succeeded": "succeeded",
    "retry": "scheduled",
    "failed": "failed",
    "cancelled": "cancelled",
}


def retry_delay(status: JobStatus) -> float:
    assert status.run_at is not None
    run_at = datetime.fromisoformat(status.run_at)
    return (run_at - datetime.fromisoformat(status.updated_at)).total_seconds()


async def assert_same(queue: Queue, job_id: str, outcome: Outcome) -> None:
    status, result = await queue.result(job_id)
    assert status.state == EXPECTED_JOB_STATE[outcome.state], (status.type, outcome.state)
    assert status.attempt == outcome.attempt and status.max_attempts == outcome.max_attempts
    assert result == outcome.result
    if outcome.progress:
        assert status.progress == outcome.progress[-1]  # the worker keeps the latest
    if outcome.error is None:
        assert status.error is None
    else:
        assert status.error is not None
        assert (status.error.type, status.error.message) == (
            outcome.error.type,
            outcome.error.message,
        )
        # the same bounded traceback, ending with the same exception line (or none, for a
        # refused result)
        if outcome.error.traceback is None:
            assert status.error.traceback is None, status.type
        else:
            assert status.error.traceback is not None, status.type
            last = outcome.error.traceback.rstrip().splitlines()[-1]
            assert status.error.traceback.rstrip().splitlines()[-1] == last, status.type
    if outcome.state == "retry":
        assert outcome.retry_in is not None
        # the same policy, without jitter (a test of the jitter is in the unit tests): the
        # same delay, to the document's millisecond
        assert abs(retry_delay(status) - outcome.retry_in) <= 0.002, status.type


async def test_a_real_worker_ends_each_job_as_run_task_says(
    jobtier_queue: Queue, jobtier_worker: BurstWorker
) -> None:
    cases: list[tuple[Task, Any, int | None]] = [
        (ok, {"a": 1}, None),
        (ok_sync, "p", None),
        (boom, None, None),  # attempt 1 of 3: retried after 0.5 s
        (boom, None, 1),  # the only attempt: dead-lettered
        (fatal, None, None),
        (permanent, None, None),
        (retry_later, None, None),
        (too_slow, None, None),
        (too_big, None, None),
        (not_json, None, None),
        (confused, None, None),
    ]
    jobs = [
        (await jobtier_queue.submit(t, payload, max_attempts=attempts)).job_id
        for t, payload, attempts in cases
    ]
    stats = await jobtier_worker(concurrency=4)
    assert stats.claimed == len(cases)
    settings = jobtier_queue.settings  # the worker's result limit
    outcomes = [
        await run_task(t, payload, max_attempts=attempts, settings=settings)
        for t, payload, attempts in cases
    ]
    assert [o.state for o in outcomes] == [
        "succeeded", "succeeded", "retry", "failed", "failed", "failed", "retry", "retry",
        "failed", "failed", "failed",
    ]  # fmt: skip
    for job_id, outcome in zip(jobs, outcomes, strict=True):
        await assert_same(jobtier_queue, job_id, outcome)


async def test_the_burst_worker_runs_flows_to_their_end(
    jobtier_queue: Queue, jobtier_worker: BurstWorker
) -> None:
    """Dependents become ready only after a resolver told them: the burst worker resolves
    between bursts, so a chain of three runs in one call."""
    from jobtier.core.model import FlowJob
    from jobtier.flows import chain

    flow = await jobtier_queue.submit_flow(
        chain(*[FlowJob(type=ok.name, payload=i) for i in range(3)])
    )
    stats = await jobtier_worker([ok])
    assert stats.claimed == stats.succeeded == 3
    assert [(await jobtier_queue.status(i)).state for i in flow.ids] == ["succeeded"] * 3


async def test_fast_forward_runs_delayed_jobs_and_every_retry_without_waiting(
    jobtier_queue: Queue, jobtier_worker: BurstWorker
) -> None:
    """A job delayed an hour, one that asks to be retried later (Retry) and one that fails,
    each of three attempts: a burst leaves them scheduled after their first; with
    ``fast_forward`` they run to their ends at once, attempts counted as their time had come,
    and a job in a queue the worker does not serve is promoted but left to its workers."""
    delayed = (await jobtier_queue.submit(ok, {"a": 1}, delay=3600)).job_id
    later = (await jobtier_queue.submit(retry_later)).job_id
    failing = (await jobtier_queue.submit(boom)).job_id
    elsewhere = (await jobtier_queue.submit(ok, 2, delay=3600, queue="elsewhere")).job_id
    first = await jobtier_worker(concurrency=4)
    assert first.claimed == 2  # the retried two's first attempts; the delayed ones wait
    states = [(await jobtier_queue.status(j)).state for j in (delayed, later, failing)]
    assert states == ["scheduled"] * 3
    stats = await jobtier_worker(concurrency=4, fast_forward=True, timeout=30)
    assert stats.claimed == 1 + 2 + 2  # the delayed job; two more attempts each
    done = {j: await jobtier_queue.status(j) for j in (delayed, later, failing, elsewhere)}
    assert done[delayed].state == "succeeded" and done[delayed].attempt == 1
    assert (done[later].state, done[later].attempt) == ("failed", 3)
    assert (done[failing].state, done[failing].attempt) == ("failed", 3)
    assert done[elsewhere].state == "queued"  # promoted; its queue's workers run it


chained: list[Queue] = []  # the queue a task below submits its next job to


@task(queue="chained")
async def forever(ctx: JobContext, payload: Any) -> None:
    await chained[0].submit(forever, None, delay=60)  # each run schedules the next


async def test_fast_forward_of_a_task_that_reschedules_itself_ends_at_its_timeout(
    jobtier_queue: Queue, jobtier_worker: BurstWorker
) -> None:
    chained[:] = [jobtier_queue]
    await jobtier_queue.submit(forever, delay=60)
    with pytest.raises(TimeoutError, match=r"fast_forward was still finding scheduled jobs"):
        await jobtier_worker([forever], fast_forward=True, timeout=1.5)


@pytest.mark.parametrize("t", [until_cancelled, until_cancelled_sync], ids=["async", "sync"])
async def test_a_cancel_ends_a_running_job_as_run_task_says(
    jobtier_queue: Queue, jobtier_worker: BurstWorker, t: Task
) -> None:
    job_id = (await jobtier_queue.submit(t)).job_id
    worker = asyncio.ensure_future(jobtier_worker())

    async def reported() -> bool:
        return (await jobtier_queue.status(job_id)).progress is not None

    await wait_for(reported, timeout=30)
    await jobtier_queue.cancel(job_id)
    stats = await worker
    assert stats.cancelled == 1
    outcome = await run_task(t, None, cancel_after_progress=1)
    assert outcome.state == "cancelled"
    status = await jobtier_queue.status(job_id)
    # a cancelled job's error says so (not an earlier attempt's error)
    assert status.state == "cancelled" and status.error is not None
    assert status.error.type == "Cancelled" and "while running" in status.error.message


async def test_the_fixtures_are_jobtiers_own_and_the_projects_fixtures_are_untouched(
    jobtier_queue: Queue, queue: Queue, settings: Settings
) -> None:
    # two servers: the plugin's session Redis and the suite's own, each emptied per test
    assert jobtier_queue.settings.redis_url != settings.redis_url
    assert queue.settings is settings and settings.shards == 4  # the suite's fixture
    assert jobtier_queue.produce.tasks is TASKS  # this module's jobtier_tasks
    await jobtier_queue.submit("ok")
    assert await jobtier_queue.redis.dbsize() > 0
    # (besides the shards' job format marks, set when the queue connected: store/format.py)
    assert [
        k async for k in queue.redis.scan_iter() if not k.endswith((b":fmt", b":fmt:done"))
    ] == []


# --- a user's project, run by pytest in a subprocess ------------------------------------------


def alive(pid: int) -> bool:
    """A redis-server with this pid runs (not exited, not a zombie)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"redis-server" in cmdline and state != "Z"


def pytest_env(path: str | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
        and not k.startswith("JOBTIER_")
    }
    if path is not None:
        env["PATH"] = path
    return env


def project(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def run_pytest(
    folder: Path, *args: str, path: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args],
        cwd=folder,
        env=pytest_env(path),
        capture_output=True,
        text=True,
        timeout=300,
    )


INI = """\
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
"""

USER_TASKS = """\
from jobtier import task

@task(retries=0)
async def double(ctx, payload):
    ctx.progress("halfway")
    return payload * 2
"""


def pids(folder: Path) -> list[int]:
    return [int(p) for p in (folder / "pids.txt").read_text().split()]


def test_the_fixtures_in_a_users_project(tmp_path: Path) -> None:
    project(
        tmp_path,
        {
            "pytest.ini": INI,
            "user_tasks.py": USER_TASKS,
            "test_user.py": """\
            import os, pytest, user_tasks

            @pytest.fixture
            def jobtier_tasks():
                return "user_tasks"

            def remember(server):
                with open("pids.txt", "a") as f:
                    f.write(f"{server.proc.pid}\\n")

            async def test_one(jobtier_redis, jobtier_queue, jobtier_worker):
                remember(jobtier_redis)
                job = await jobtier_queue.submit("double", 21)
                await jobtier_queue.redis.set("left-behind", "1")
                stats = await jobtier_worker()
                assert stats.succeeded == 1
                status, result = await jobtier_queue.result(job.job_id)
                assert (status.state, result, status.progress) == ("succeeded", 42, "halfway")

            async def test_two_sees_an_empty_redis(jobtier_redis, jobtier_queue):
                remember(jobtier_redis)
                held = [k async for k in jobtier_queue.redis.scan_iter()]
                assert [k for k in held if not k.endswith((b":fmt", b":fmt:done"))] == []  # (format marks)

            async def test_unknown_types_are_refused_by_the_queue(jobtier_queue):
                from jobtier.core.errors import UnknownTask
                with pytest.raises(UnknownTask):
                    await jobtier_queue.submit("nope")

            async def test_explicit_tasks_and_a_hang_bounded(jobtier_queue, jobtier_worker):
                import asyncio
                from jobtier import task

                @task
                async def hangs(ctx, payload):
                    await asyncio.Event().wait()

                job = await jobtier_queue.submit("double", 1)  # known to the queue
                jobtier_queue.produce.tasks = None
                stuck = await jobtier_queue.submit("hangs")
                with pytest.raises(TimeoutError, match="does a task hang"):
                    await jobtier_worker([hangs, user_tasks.double], timeout=1)
                assert (await jobtier_queue.status(job.job_id)).state == "succeeded"
                assert (await jobtier_queue.status(stuck.job_id)).state == "queued"  # released
            """,
            # no jobtier_tasks: the queue looks nothing up (no worker advertised in an
            # emptied Redis), a job submitted by name runs on the worker given its tasks
            "test_no_tasks.py": """\
            async def test_submit_by_name_then_run_the_worker(jobtier_queue, jobtier_worker):
                job = await jobtier_queue.submit("double", 21)
                stats = await jobtier_worker("user_tasks")
                assert stats.succeeded == 1
                assert (await jobtier_queue.result(job.job_id))[1] == 42
            """,
        },
    )
    out = run_pytest(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 passed" in out.stdout
    first, second = pids(tmp_path)
    assert first == second  # one server for the session
    assert not alive(first)  # and stopped at its end


def test_the_server_is_stopped_when_tests_fail_and_fixtures_error(tmp_path: Path) -> None:
    project(
        tmp_path,
        {
            "pytest.ini": INI,
            "test_bad.py": """\
            import pytest

            @pytest.fixture
            def broken(jobtier_redis):
                with open("pids.txt", "a") as f:
                    f.write(f"{jobtier_redis.proc.pid}\\n")
                raise RuntimeError("a fixture of the user's breaks")

            def test_fails(jobtier_settings):
                assert False, "a failing test"

            def test_errors(broken):
                pass
            """,
        },
    )
    out = run_pytest(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed" in out.stdout and "1 error" in out.stdout
    (pid,) = pids(tmp_path)
    assert not alive(pid)


def test_the_server_is_stopped_when_the_run_is_interrupted(tmp_path: Path) -> None:
    project(
        tmp_path,
        {
            "pytest.ini": INI,
            "test_slow.py": """\
            import time

            def test_waits_for_ctrl_c(jobtier_settings, jobtier_redis):
                with open("pids.txt", "w") as f:
                    f.write(f"{jobtier_redis.proc.pid}\\n")
                for _ in range(6000):  # bound: a broken test ends, it does not hang
                    time.sleep(0.01)
            """,
        },
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=pytest_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(6000):  # until the test runs (bounded, not a timing assertion)
            if (tmp_path / "pids.txt").exists() and (tmp_path / "pids.txt").read_text():
                break
            if proc.poll() is not None:
                break
            time.sleep(0.01)
        (pid,) = pids(tmp_path)
        assert alive(pid)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in output, output
    assert not alive(pid)


def test_loading_the_plugin_starts_nothing_and_imports_no_engine(tmp_path: Path) -> None:
    project(
        tmp_path,
        {
            "pytest.ini": INI,
            "conftest.py": """\
            import json, sys

            def pytest_sessionfinish(session):
                loaded = sorted(
                    m for m in sys.modules
                    if m.split(".")[0] in ("jobtier", "redis", "msgspec", "hiredis")
                )
                with open("modules.json", "w") as f:
                    json.dump(loaded, f)
            """,
            "test_plain.py": """\
            def test_nothing_of_jobtier():
                assert 1 + 1 == 2
            """,
        },
    )
    out = run_pytest(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    loaded = (tmp_path / "modules.json").read_text()
    assert loaded == '["jobtier", "jobtier.testing", "jobtier.testing.plugin"]'
    # no fixture asked: the module that starts servers was never imported, so none started

    out = run_pytest(tmp_path, "-p", "no:jobtier")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "modules.json").read_text() == "[]"


def test_without_redis_server_the_tests_are_skipped_with_how_to_install_it(
    tmp_path: Path,
) -> None:
    bin_dir = tmp_path / "bin"  # a PATH with no redis-server on it
    bin_dir.mkdir()
    project(
        tmp_path,
        {
            "pytest.ini": INI,
            "test_needs_redis.py": """\
            async def test_a(jobtier_queue):
                raise AssertionError("ran without a server")

            def test_b(jobtier_settings):
                raise AssertionError("ran without a server")
            """,
        },
    )
    out = run_pytest(tmp_path, path=str(bin_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 skipped" in out.stdout
    assert "redis-server is not on PATH" in out.stdout
    assert "apt-get install redis-server" in out.stdout

    (tmp_path / "pytest.ini").write_text(INI + "jobtier_require_redis = true\n")
    out = run_pytest(tmp_path, path=str(bin_dir))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 errors" in out.stdout and "apt-get install redis-server" in out.stdout


def test_the_example_passes(tmp_path: Path) -> None:
    out = run_pytest(ROOT / "examples", "-v", "--basetemp", str(tmp_path / "base"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "configfile: pytest.ini" in out.stdout  # the example's own configuration
    # every one passed, none failed or skipped: the summary line (the tests' own logs above
    # it may say "failed", of the jobs they fail on purpose)
    summary = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"=+ \d+ passed in [\d.]+s(?: \([\d:]+\))? =+", summary), summary
