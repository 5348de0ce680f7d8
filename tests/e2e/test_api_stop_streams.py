"""An API told to stop ends its open streams, and stops: a console open in a tab (the
dashboard's stream) and a job's events while it waits held a stopped `jobtier api` up for as
long as their clients stayed, under both servers (each waits for the responses in flight).
Real processes (`jobtier api`), a real Redis; the streams are ended cleanly, and the client
of a job's events then reconnects (to another API, in a deployment)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from jobtier.config import Settings
from jobtier.dev.local_redis import free_port
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
