"""`jobtier run` as a user runs it: local Redis and Postgres, every part, the demo tasks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from jobtier.dev.redis import free_port


def test_run_serves_the_demo_and_stops_cleanly() -> None:
    data = Path(
        tempfile.mkdtemp(prefix="jobtier-run-")
    )  # Postgres runs as another user: not tmp_path
    data.chmod(0o755)
    redis_port, pg_port, api_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
    env["JOBTIER_API_PORT"] = str(api_port)
    args = [sys.executable, "-m", "jobtier.cli", "run", "--data-dir", str(data),
            "--redis-port", str(redis_port), "--pg-port", str(pg_port)]  # fmt: skip
    # stderr inherited: pytest captures its log with the test's, shown if the test fails (a
    # pipe read only at the end would block the process once full)
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{api_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "jobtier run exited (its log is in the captured stderr)"
            try:
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "jobtier run never became ready"
            time.sleep(0.2)
        key = json.loads((data / "dev-keys.json").read_text())["tenant_key"]
        auth = {"authorization": f"Bearer {key}"}
        job = httpx.post(
            f"{base}/v1/jobs", json={"type": "echo", "payload": "hi"}, headers=auth
        ).json()
        while (
            state := httpx.get(f"{base}/v1/jobs/{job['id']}", headers=auth).json()["state"]
        ) != "succeeded":
            assert state in ("queued", "running"), state
            assert time.monotonic() < deadline + 30
            time.sleep(0.05)
        assert (
            httpx.get(f"{base}/v1/jobs/{job['id']}/result", headers=auth).json()["result"] == "hi"
        )
        while not httpx.get(f"{base}/v1/jobs", headers=auth).json()[
            "jobs"
        ]:  # the persister wrote it
            assert time.monotonic() < deadline + 30
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, f"jobtier run exited with {code} (its log is in the captured stderr)"
    for port in (redis_port, pg_port, api_port):  # the services it started are stopped
        try:
            httpx.get(f"http://127.0.0.1:{port}", timeout=0.5)
            raise AssertionError(f"something still listens on {port}")
        except httpx.TransportError:
            pass
