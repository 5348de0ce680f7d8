"""An API told to stop ends its open streams, and stops: a console open in a tab (the
dashboard's stream) and a job's events while it waits held a stopped `jobtier api` up for as
long as their clients stayed, under both servers (each waits for the responses in flight).
Real processes (`jobtier api`), a real Redis; the streams are ended cleanly, and the client
of a job's events then reconnects (to another API, in a deployment)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from jobtier.api import worker_claims
from jobtier.api.sse import end_streams
from jobtier.config import Settings
from jobtier.dev.local_redis import free_port
from jobtier.store.fitness import STARTUP_PATIENCE
from tests.e2e.test_http_worker import serve, submit, worker_client
from tests.fixtures.api import StartApi
from tests.fixtures.engine import wait_for

KEY, ADMIN = "k-stop", "a-stop"
HANG_GUARD = 30.0  # s: before the change the process never stopped while a client stayed


@pytest.mark.parametrize("server", ["granian", "uvicorn"])
@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_a_stopped_api_ends_its_streams_and_exits(
    pg_settings: Settings, server: str, tmp_path: Path
) -> None:
    settings = pg_settings
    port = free_port()
    env = {
        **os.environ,
        "JOBTIER_REDIS_URL": settings.redis_url,
        "JOBTIER_SHARDS": str(settings.shards),
        "JOBTIER_API_KEYS": f"{KEY}:acme",
        "JOBTIER_ADMIN_KEY": ADMIN,
        "JOBTIER_API_PORT": str(port),
        "JOBTIER_API_SERVER": server,
        "JOBTIER_API_WORKERS": "1",  # one server process (uvicorn's supervisor exits otherwise)
        "JOBTIER_REQUIRE_KNOWN_TYPES": "0",
        "JOBTIER_DATABASE_URL": pg_settings.database_url,
    }
    log = (tmp_path / "api.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobtier.cli", "api"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its server's worker processes are stopped with it, below
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with (
            httpx.AsyncClient(base_url=url, timeout=10, headers={"authorization": f"Bearer {ADMIN}"}) as admin,
            httpx.AsyncClient(base_url=url, timeout=10, headers={"authorization": f"Bearer {KEY}"}) as tenant,
        ):  # fmt: skip

            async def ready() -> bool:
                assert proc.poll() is None, (tmp_path / "api.log").read_text()
                try:
                    return (await admin.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_for(ready, timeout=HANG_GUARD)
            job = (await tenant.post("/v1/jobs", json={"type": "nobody.runs"})).json()["id"]
            async with (
                admin.stream("GET", "/v1/admin/dashboard/stream") as console,
                tenant.stream("GET", f"/v1/jobs/{job}/events") as events,
            ):
                console_lines, event_lines = console.aiter_lines(), events.aiter_lines()
                assert (await anext(console_lines)).startswith("event: frame")
                assert (await anext(event_lines)).startswith(("retry:", "id:", "event:"))
                proc.send_signal(signal.SIGTERM)
                # both streams end, cleanly (no error reading them), while their clients stay
                async with asyncio.timeout(HANG_GUARD):
                    rest = (
                        [line async for line in console_lines],
                        [line async for line in event_lines],
                    )
                assert all(": the server is stopping" in lines for lines in rest), rest
            code = await asyncio.to_thread(proc.wait, HANG_GUARD)
        # uvicorn raises the signal it caught again once it has stopped: killed by it, as asked
        assert code == (0 if server == "granian" else -signal.SIGTERM), (
            tmp_path / "api.log"
        ).read_text()
        assert (
            "Application shutdown complete" in (tmp_path / "api.log").read_text()
            or server == "granian"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):  # granian's worker outlives a killed main
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


STARTING_BOUND = 20.0  # s: under STARTUP_PATIENCE (30 s), which ended uvicorn's wait before


@pytest.mark.parametrize("server", ["granian", "uvicorn"])
async def test_an_api_stopped_while_waiting_for_redis_exits_at_once(
    server: str, tmp_path: Path
) -> None:
    """Stopped as a Ctrl-C stops it (SIGINT to every process of the group) while it waits for
    a Redis that does not answer: the process ends. Before, granian's worker hung for good
    (its handler, told twice before the server serves, blocks) and uvicorn waited out its
    patience."""
    env = {
        **os.environ,
        "JOBTIER_REDIS_URL": f"redis://127.0.0.1:{free_port()}",  # nobody listens there
        "JOBTIER_API_KEYS": f"{KEY}:acme",
        "JOBTIER_ADMIN_KEY": ADMIN,
        "JOBTIER_API_PORT": str(free_port()),
        "JOBTIER_API_SERVER": server,
        "JOBTIER_API_WORKERS": "1",
    }
    env.pop("JOBTIER_DATABASE_URL", None)
    path = tmp_path / "api.log"
    log = path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobtier.cli", "api"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def waiting() -> bool:
            assert proc.poll() is None, path.read_text()
            return "event=redis_unreachable" in path.read_text()

        await wait_for(waiting, timeout=HANG_GUARD)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = await asyncio.to_thread(proc.wait, STARTING_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STARTING_BOUND} s after a Ctrl-C:\n{path.read_text()}")
        text = path.read_text()
        # the command waits for Redis before it starts a server: the Ctrl-C ends it, by the
        # signal, whichever server it would have started
        assert re.search(r"event=api_stopped_while_starting signal=SIGINT", text), text
        assert code == -signal.SIGINT, text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


async def test_an_api_whose_redis_never_answers_says_so_in_one_line(tmp_path: Path) -> None:
    """Redis unreachable past the patience: one line saying where and what to check, exit 2,
    no server started. Before, granian's worker wrote three chained tracebacks (the reason
    buried in them), then its main process 'Unexpected exit from worker-1', status 1."""
    url = f"redis://127.0.0.1:{free_port()}"  # nobody listens there
    env = {
        **os.environ,
        "JOBTIER_REDIS_URL": url,
        "JOBTIER_API_KEYS": f"{KEY}:acme",
        "JOBTIER_ADMIN_KEY": ADMIN,
        "JOBTIER_API_PORT": str(free_port()),
        "JOBTIER_API_SERVER": "granian",
    }
    env.pop("JOBTIER_DATABASE_URL", None)
    r = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "jobtier.cli", "api"],
        env=env,
        capture_output=True,
        text=True,
        timeout=STARTUP_PATIENCE + 60,
    )
    assert r.returncode == 2, r.stderr
    assert f"jobtier: configuration error: cannot reach Redis at {url}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Unexpected exit" not in r.stderr, r.stderr
    assert "refused.." not in r.stderr  # redis-py's full stop, and ours after it


async def test_long_polls_answer_at_once_once_the_api_is_told_to_stop(
    start_api: StartApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status read's ``wait`` and an HTTP worker's claim, parked, answer as at their
    timeout once the API is told to stop (as its streams end), and later ones do not wait:
    each held a stopping server up for its whole wait before."""
    monkeypatch.setattr(worker_claims, "IDLE_LOOK", 3600.0)  # only the stop may end the claim
    api = await serve(start_api)
    state = api.server.lifespan.state
    claims = state["worker_claims"]
    job = await submit(api, {"a": 1, "b": 2})  # queued: the claim below asks another queue
    unchanged = {"if-none-match": '"1"'}
    claim = {"worker": "w1", "types": ["http.add"], "queues": ["idle"], "wait": 60}
    async with api.client() as c, worker_client(api) as w:
        poll = asyncio.create_task(c.get(f"/v1/jobs/{job}?wait=60", headers=unchanged))
        claiming = asyncio.create_task(w.post("/v1/worker/claim", json=claim))
        await wait_for(lambda: api.reader.stats()["listeners"] == 1 and claims.waiting() == 1)
        end_streams(state)  # what SIGTERM or SIGINT does (the test above sends them)
        async with asyncio.timeout(HANG_GUARD):
            polled, claimed = await poll, await claiming
            assert polled.status_code == 304, polled.text
            assert claimed.status_code == 200 and claimed.json()["jobs"] == [], claimed.text
            again = await c.get(f"/v1/jobs/{job}?wait=60", headers=unchanged)
            assert again.status_code == 304, again.text
            claimed = await w.post("/v1/worker/claim", json=claim)
            assert claimed.status_code == 200 and claimed.json()["jobs"] == [], claimed.text


READY_IN_TIME = """
import asyncio, os, signal
from jobtier.api.sse import END_GRACE, on_stop_signals

async def main():
    starting = [True]
    signal.signal(signal.SIGTERM, lambda *_: None)  # the server's own handler, told too
    on_stop_signals(asyncio.Event(), end_process=lambda: starting[0])
    os.kill(os.getpid(), signal.SIGTERM)  # told to stop while it starts...
    await asyncio.sleep(0.1)
    starting[0] = False  # ...and ready before the grace ran out
    await asyncio.sleep(END_GRACE * 2)
    print("serving", flush=True)

asyncio.run(main())
"""


def test_an_api_ready_within_the_grace_is_left_to_its_server() -> None:
    """Told to stop while starting, then ready before the grace ran out: the process is not
    ended by the signal (its server, told by the same signal, stops it as it stops any,
    letting the requests in flight finish), where it was, requests and all."""
    done = subprocess.run(
        [sys.executable, "-c", READY_IN_TIME], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout.strip()) == (0, "serving"), done
