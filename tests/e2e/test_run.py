"""`jobtier run` as a user runs it: local Redis and Postgres, every part, the demo tasks; and
its servers stopped on every way out, never someone else's server used."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
import redis as syncredis

from jobtier.dev.local_postgres import LocalPostgres
from jobtier.dev.procs import pid_alive
from tests.e2e.jobtier_run import (
    HANG_GUARD,
    JobtierRun,
    assert_gone,
    copy_pg_template,
    wait_until,
)


@pytest.fixture(scope="module")
def pg_template() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="jobtier-run-pg-"))
    folder.chmod(0o755)
    server = LocalPostgres(folder / "pg").start()  # initdb, role and database
    server.stop()
    yield folder / "pg"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def data(pg_template: Path) -> Iterator[Path]:
    """A data folder for `jobtier run`, its Postgres already initialised."""
    # not tmp_path: its root is private to root, and Postgres runs as another user
    folder = Path(tempfile.mkdtemp(prefix="jobtier-run-"))
    folder.chmod(0o755)
    copy_pg_template(pg_template, folder / ".data")
    yield folder / ".data"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[list[JobtierRun]]:
    """Start runs with ``JobtierRun(..)`` and append them: stopped at teardown."""
    started: list[JobtierRun] = []
    yield started
    for run in started:
        run.stop()


def start(runs: list[JobtierRun], data: Path, log: Path, *args: str, **ports: int) -> JobtierRun:
    run = JobtierRun(data, log, *args, **ports)
    runs.append(run)
    return run


def submit(run: JobtierRun, type: str, payload: object) -> str:
    auth = {"authorization": f"Bearer {run.tenant_key()}"}
    reply = httpx.post(f"{run.base}/v1/jobs", json={"type": type, "payload": payload}, headers=auth)
    assert reply.status_code == 202, reply.text
    return str(reply.json()["id"])


def state(run: JobtierRun, job_id: str) -> str:
    auth = {"authorization": f"Bearer {run.tenant_key()}"}
    return str(httpx.get(f"{run.base}/v1/jobs/{job_id}", headers=auth).json()["state"])


def test_run_serves_the_demo_and_stops_cleanly(
    data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    run = start(runs, data, tmp_path / "run.log")
    run.wait_ready()
    servers = run.server_pids()
    job = submit(run, "echo", "hi")
    wait_until(lambda: state(run, job) == "succeeded", "the job succeeds")
    auth = {"authorization": f"Bearer {run.tenant_key()}"}
    assert httpx.get(f"{run.base}/v1/jobs/{job}/result", headers=auth).json()["result"] == "hi"
    wait_until(  # the persister wrote it
        lambda: bool(httpx.get(f"{run.base}/v1/jobs", headers=auth).json()["jobs"]),
        "the job in Postgres",
    )
    # the banner's exports are all the admin commands need, the admin ones included
    wait_until(lambda: "  export JOBTIER_URL=" in run.text(), "the banner")
    (line,) = [x for x in run.text().splitlines() if x.startswith("  export JOBTIER_URL=")]
    exports = dict(pair.split("=", 1) for pair in line.split()[1:])
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")} | exports
    for command in (["jobs", "show", job], ["queues"], ["dead-letters", "list"]):
        done = subprocess.run(
            [sys.executable, "-m", "jobtier.cli.main", *command],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0 and done.stderr == "", (command, done.stderr)
    # and the worker key it names lets an HTTP worker in (docs/http-workers.md)
    (worker_key,) = re.findall(r"WORKER_KEY=(\S+)", run.text())
    body = {"worker": "w1", "types": ["http.x"], "wait": 0}
    r = httpx.post(
        f"{run.base}/v1/worker/claim", json=body, headers={"authorization": f"Bearer {worker_key}"}
    )
    assert r.status_code == 200 and r.json()["jobs"] == [], r.text
    run.proc.send_signal(signal.SIGTERM)
    assert run.exit_code() == 0, run.text()[-3000:]
    assert_gone(servers)
    assert "local_redis_reused" not in run.events()


HELD_START = """
import asyncio
import os
from pathlib import Path

from jobtier.demo import *  # noqa: F403  (echo, sleep, fail, cpu)
from jobtier.persist.results import PostgresResultStore

_connect = PostgresResultStore.connect.__func__


async def _held(cls, database_url):  # the worker's results reader, opened at its start
    Path(os.environ["HELD_START_HELD"]).touch()
    while not Path(os.environ["HELD_START_RELEASE"]).exists():
        await asyncio.sleep(0.05)
    return await _connect(cls, database_url)


PostgresResultStore.connect = classmethod(_held)
"""


def test_the_api_serves_once_the_worker_has_advertised_its_tasks(
    data: Path, tmp_path: Path, runs: list[JobtierRun], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a worker held as it opens its stores: the API it would advertise its tasks to is not
    # served meanwhile, so a job submitted as soon as the API answers is taken, not refused
    # with 422 "no worker runs task"
    (tmp_path / "held_start.py").write_text(HELD_START)
    held, release = tmp_path / "held", tmp_path / "release"
    monkeypatch.setenv("HELD_START_HELD", str(held))
    monkeypatch.setenv("HELD_START_RELEASE", str(release))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    )
    run = start(runs, data, tmp_path / "run.log", "--tasks", "held_start")
    wait_until(held.exists, "the worker held at its start")
    # an absence, watched for 2 s: an API started beside the worker answers well within them
    watched = time.monotonic() + 2.0
    while time.monotonic() < watched:
        assert run.proc.poll() is None, run.text()[-3000:]
        with contextlib.suppress(httpx.TransportError):
            reply = httpx.get(f"{run.base}/readyz")
            raise AssertionError(f"the API answered {reply.status_code} before its worker started")
        time.sleep(0.05)
    release.touch()
    run.wait_ready()
    job = submit(run, "echo", "at once")
    wait_until(lambda: state(run, job) == "succeeded", "the job succeeds")
    wait_until(lambda: "jobtier is running" in run.text(), "the banner")
    assert run.text().index("event=worker_started ") < run.text().index("jobtier is running")


async def _history(dsn: str, job_id: str) -> list[tuple[str | None, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT from_state, to_state FROM job_transitions WHERE job_id = $1 ORDER BY version",
            job_id,
        )
    finally:
        await conn.close()
    return [(r["from_state"], r["to_state"]) for r in rows]


def test_a_stopped_run_has_written_what_its_worker_did_last(
    data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    """The persister stops after the worker: the job the stopping worker hands back (its
    grace over) is back in its queue in Postgres once the run has ended, not at the next
    start. (Before, every part stopped at once, and the release stayed in the Redis log.)"""
    run = start(runs, data, tmp_path / "run.log", "--grace", "0.5")
    run.wait_ready()
    job = submit(run, "sleep", {"seconds": 600})
    wait_until(lambda: state(run, job) == "running", "the job runs")
    run.proc.send_signal(signal.SIGTERM)
    assert run.exit_code() == 0, run.text()[-3000:]
    # the run's own Postgres, started again on its data to read what it holds
    pg = LocalPostgres(data / "pg").start()
    try:
        history = asyncio.run(_history(pg.dsn, job))
    finally:
        pg.stop()
    assert history[-1] == ("running", "queued"), history
    events = run.events()
    assert events.index("worker_stopped") < events.index("persister_stopped"), events


@pytest.mark.parametrize("how", ["SIGTERM twice", "SIGINT twice", "SIGHUP"])
def test_every_way_out_stops_the_servers(
    how: str, data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    # twice: a long grace, which only the second signal can cut short
    grace = "600" if how.endswith("twice") else "1"
    run = start(runs, data, tmp_path / "run.log", "--grace", grace)
    run.wait_ready()
    servers = run.server_pids()
    job = submit(run, "sleep", {"seconds": 600})
    wait_until(lambda: state(run, job) == "running", "the job runs")
    sig = signal.Signals[how.split()[0]]
    run.proc.send_signal(sig)
    if how.endswith("twice"):
        run.wait_logged("worker_draining")
        run.proc.send_signal(sig)
    code = run.exit_code()
    assert_gone(servers)
    events = run.events()
    assert "job_released" in events  # the running job went back to its queue
    assert "forced_exit" not in events
    if how == "SIGHUP":
        assert code == 0 and "signal=SIGHUP action=graceful_stop" in run.text()
    else:
        assert "action=stop_now" in run.text()


def test_a_sighup_ends_an_open_console_stream_and_the_run_stops(
    data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    """A console tab open: a run stopping on SIGHUP (its terminal closed), which is not a
    signal the API's streams watch, ends the stream itself, and stops. Before, uvicorn
    waited for the open stream, and with the terminal gone no second signal would come."""
    run = start(runs, data, tmp_path / "run.log", "--grace", "1")
    run.wait_ready()
    _, admin = run.keys()
    lines: list[str] = []
    opened = threading.Event()

    def follow() -> None:
        url = f"http://127.0.0.1:{run.api_port}/v1/admin/dashboard/stream"
        headers = {"authorization": f"Bearer {admin}"}
        with httpx.stream("GET", url, headers=headers, timeout=HANG_GUARD) as stream:
            for line in stream.iter_lines():
                lines.append(line)
                opened.set()

    reader = threading.Thread(target=follow, daemon=True)  # a daemon: never holds pytest up
    reader.start()
    assert opened.wait(HANG_GUARD), run.text()[-2000:]
    run.proc.send_signal(signal.SIGHUP)
    assert run.exit_code() == 0, run.text()[-3000:]
    reader.join(HANG_GUARD)
    assert ": the server is stopping" in lines, lines[-3:]


def test_a_failing_part_stops_everything(
    data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    """The run's own Redis killed under it: the run says so and stops, every part and the
    Postgres with it. Before, every part retried against the closed port for ever, warning
    three times a second and never saying why, the Redis left a zombie."""
    run = start(runs, data, tmp_path / "run.log")
    run.wait_ready()
    servers = run.server_pids()
    redis = int(run.field("local_redis_started", "pid"))
    os.kill(redis, signal.SIGKILL)
    run.wait_logged("part_failed")
    assert run.exit_code() == 1
    assert_gone(servers)
    assert f"the local Redis (pid {redis}) exited, killed by SIGKILL" in run.text()
    assert "local_service_exited" in run.events()
    assert "worker_stopped" in run.events()
    # at once, with no grace: nothing could be reported to the Redis that is gone
    assert "worker_stop_now" in run.events(), run.text()[-3000:]


def test_a_taken_api_port_is_refused_before_anything_starts(
    data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = start(runs, data, tmp_path / "run.log", api_port=port)
        assert run.exit_code() == 1
    text = run.text()
    assert f"the API cannot listen on 127.0.0.1:{port}" in text and "--api-port" in text
    # refused first: no server was started to be stopped again (it was, with the migrations
    # and every part, then all stopped when the API failed)
    assert "local_redis_started" not in run.events(), text[-2000:]
    assert "Traceback" not in text


def test_sigkill_takes_the_servers_with_it_and_a_leftover_is_restarted(
    data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    run = start(runs, data, tmp_path / "run1.log")
    run.wait_ready()
    servers = run.server_pids()
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait()
    assert_gone(servers)  # no Python code ran: the kernel stopped them

    # a Redis of this folder that outlived its run (say, from a version without this tie):
    # the next run restarts it as its own rather than adopting it
    folder = data / "redis"
    leftover = _daemonized_redis(folder, run.redis_port)  # same folder, port and pidfile
    again = start(runs, data, tmp_path / "run2.log", redis_port=run.redis_port)
    again.wait_ready()
    assert again.field("local_redis_leftover", "pid") == str(leftover)
    assert not pid_alive(leftover)
    assert int(again.field("local_redis_started", "pid")) != leftover
    new_servers = again.server_pids()
    again.proc.send_signal(signal.SIGTERM)
    assert again.exit_code() == 0
    assert_gone(new_servers)


def _daemonized_redis(folder: Path, port: int) -> int:
    import subprocess

    subprocess.run(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
         "--appendonly", "yes", "--daemonize", "yes", "--pidfile", str(folder / "redis.pid"),
         "--logfile", str(folder / "leftover.log")],
        check=True,
    )  # fmt: skip
    wait_until(lambda: (folder / "redis.pid").exists(), "the leftover's pidfile")
    return int((folder / "redis.pid").read_text())


def test_a_foreign_redis_on_the_port_is_refused_and_left_alone(
    data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    from jobtier.dev.local_redis import LocalRedis

    other = LocalRedis(tmp_path / "someone-elses-redis").start()
    try:
        client = syncredis.Redis(port=other.port)
        client.set("theirs", "untouched")
        run = start(runs, data, tmp_path / "run.log", redis_port=other.port)
        assert run.exit_code() == 1
        said = run.text()
        assert f"port {other.port} is in use by a Redis" in said
        assert str(tmp_path / "someone-elses-redis") in said  # what it found
        assert "--redis-port" in said  # and what to do
        assert other.proc is not None and other.proc.poll() is None
        assert client.get("theirs") == b"untouched" and client.dbsize() == 1
        assert "local_postgres_started" not in run.events()
        client.close()
    finally:
        other.stop()


def test_a_foreign_postgres_on_the_port_is_refused_and_left_alone(
    data: Path, tmp_path: Path, runs: list[JobtierRun], pg_server: LocalPostgres
) -> None:
    run = start(runs, data, tmp_path / "run.log", pg_port=pg_server.port)
    assert run.exit_code() == 1
    said = run.text()
    assert f"port {pg_server.port} is in use by a Postgres with data folder" in said
    assert str(pg_server.data) in said and "--pg-port" in said
    assert_gone([int(run.field("local_redis_started", "pid"))])  # the Redis it had started
    assert pg_server.psql("SELECT 1").strip() == "1"  # theirs serves on


def test_a_restart_waits_for_redis_to_load_its_aof(
    data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    run = start(runs, data, tmp_path / "run1.log")
    run.wait_ready()
    client = syncredis.Redis(port=run.redis_port)
    keys = 20_000
    pipe = client.pipeline(transaction=False)
    for i in range(keys // 1000):
        pipe.mset({f"bulk:{i}:{j}": "x" * 40 for j in range(1000)})
    pipe.execute()
    client.bgrewriteaof()  # the keys go into the AOF's base file, loaded key by key
    wait_until(
        lambda: not any(
            int(client.info("persistence")[f]) for f in ("aof_rewrite_in_progress",
                                                          "aof_rewrite_scheduled")
        ),
        "the AOF rewrite",
    )  # fmt: skip
    client.close()
    run.proc.send_signal(signal.SIGTERM)
    assert run.exit_code() == 0
    # make the load slow for certain (a debugging delay per key) and visible (the server
    # answers during the load every KB instead of every 2 MB): whatever the machine's speed,
    # the next start meets a Redis that is loading
    (data / "redis" / "redis.local.conf").write_text(
        "key-load-delay 50\nloading-process-events-interval-bytes 1024\n"
    )
    again = start(runs, data, tmp_path / "run2.log", redis_port=run.redis_port)
    again.wait_ready()
    assert "local_redis_loading" in again.events()
    client = syncredis.Redis(port=again.redis_port)
    assert client.dbsize() >= keys  # all of it came back
    assert client.info("persistence")["aof_enabled"] == 1
    client.close()
    assert "appendonly is off" not in again.text()
    again.proc.send_signal(signal.SIGTERM)
    assert again.exit_code() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the relocation applies when running as root")
def test_a_clone_others_cannot_enter_runs_as_root(tmp_path: Path, runs: list[JobtierRun]) -> None:
    from jobtier.dev.local_postgres import relocated_folder

    home = Path(tempfile.mkdtemp(prefix="jobtier-root-home-"))  # 0700, like /root
    assert home.stat().st_mode & 0o777 == 0o700
    data = home / "clone" / ".data"
    moved = relocated_folder(data / "pg")
    try:
        run = start(runs, data, tmp_path / "run.log")
        run.wait_ready()
        assert run.field("local_postgres_relocated", "to") == str(moved)
        assert (data / "pg" / "DATA-IS-ELSEWHERE.txt").read_text().count(str(moved)) == 1
        job = submit(run, "echo", {"from": "a private clone"})
        wait_until(lambda: state(run, job) == "succeeded", "the job succeeds")
        auth = {"authorization": f"Bearer {run.tenant_key()}"}
        wait_until(  # Postgres, running as another user, has it
            lambda: bool(httpx.get(f"{run.base}/v1/jobs", headers=auth).json()["jobs"]),
            "the job in Postgres",
        )
        servers = run.server_pids()
        run.proc.send_signal(signal.SIGTERM)
        assert run.exit_code() == 0
        assert_gone(servers)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(moved, ignore_errors=True)


def test_a_second_run_of_the_same_folder_is_refused(
    data: Path, tmp_path: Path, runs: list[JobtierRun]
) -> None:
    first = start(runs, data, tmp_path / "run1.log")
    first.wait_ready()
    servers = first.server_pids()
    second = start(runs, data, tmp_path / "run2.log")
    assert second.exit_code() == 1
    assert f"another `jobtier run` (pid {first.proc.pid}) is using {data}" in second.text()
    # the first run's servers are untouched (its Redis and postmaster; Postgres's own
    # worker processes come and go with connections)
    assert all(pid_alive(p) for p in servers[:2])
    assert httpx.get(f"{first.base}/readyz").status_code == 200
