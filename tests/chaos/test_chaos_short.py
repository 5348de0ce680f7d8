"""The chaos soak, short: bench/chaos.py --short, run exactly as a user runs it.

Separate processes started with the real CLI (api, two workers, scheduler, two persisters)
against their own Redis (AOF) and Postgres, under load over HTTP, while every role —
Redis and Postgres included — is killed a few times and restarted; then its auditor's
invariants are asserted here from the JSON it writes. The bound on the run is a hang guard
only: the soak itself waits for events (readiness, settling), never for fixed times.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHAOS = ROOT / "bench" / "chaos.py"
ROLES = ("worker", "persister", "scheduler", "api", "redis", "postgres")


def test_short_chaos_soak_keeps_every_invariant(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(CHAOS), "--short", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the soak stops its servers and processes
        output, _ = proc.communicate(timeout=120)
        pytest.fail("the soak hung:\n" + output.decode(errors="replace")[-6000:])
    text = output.decode(errors="replace")
    assert (tmp_path / "chaos.json").exists(), text[-6000:]
    data = json.loads((tmp_path / "chaos.json").read_text())
    res, audit = data["results"], data["audit"]
    explain = text[-6000:]

    assert res["violations"] == [], explain
    assert proc.returncode == 0, explain
    assert all(res["kills"].get(role, 0) >= 3 for role in ROLES), res["kills"]
    assert res["settled"], explain
    # every acknowledged job accounted for, terminal, and succeeded (the flaky ones retry)
    assert audit["acknowledged"] == res["producer"]["acknowledged"] > 500
    assert res["producer"]["acknowledged"] == res["producer"]["submitted"]
    assert audit["terminal_states"] == {"succeeded": audit["acknowledged"]}
    for found in ("lost", "vanished_from_redis", "not_terminal", "double_success",
                  "history_problems", "pg_differs"):  # fmt: skip
        assert audit[found]["count"] == 0, (found, audit[found])
    assert audit["lag_after_drain"] == 0
    assert audit["history_rows"] >= 3 * audit["acknowledged"]
    assert not [e for e in res["unexpected_exits"] if e["role"] == "persister"]
    assert res["logs"]["api"]["tracebacks"] == 0, explain  # LOADING and outages: one line
    assert res["logs"]["persister"]["tracebacks"] == 0, explain
    # a worker logs each failed attempt's traceback: the flaky task's are counted apart, and
    # any other traceback (a crash in the claim, report or heartbeat loops) is a defect
    assert res["logs"]["worker"]["tracebacks"] == 0, explain
    assert res["logs"]["worker"]["task_failures"] > 0  # the flaky task's failures were seen
    assert res["logs"]["scheduler"]["tracebacks"] == 0, explain
    # the outages happened and were seen through
    assert res["logs"]["persister"]["postgres_unavailable"] > 0
    assert res["recovery"]["Redis restart"]["submits"]["n"] >= 1
