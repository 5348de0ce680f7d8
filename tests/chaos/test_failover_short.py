"""The failover bench, short: bench/failover.py with one master failover on each set-up (a
3 + 3 Redis Cluster, and a master and replica under three Sentinels), run as a user runs it.

It asserts that the bench did its work and measured it — the failover took place (killed,
promoted, the killed node back as a replica), the audit read every acknowledged job, the
recovery and the responses were counted — not that the system rode through without errors:
tests/integration/test_failover.py asserts that. The bound on the run is a hang guard only.
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
FAILOVER = ROOT / "bench" / "failover.py"


def test_one_failover_on_each_setup_is_measured_and_audited(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(FAILOVER), "--failovers", "1", "--setups", "cluster,sentinel",
        "--durable", "off", "--rate", "50", "--senders", "32", "--warmup", "2", "--gap", "0",
        "--settle", "30", "--ready-timeout", "60", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the bench stops its servers and processes
        output, _ = proc.communicate(timeout=120)
        pytest.fail("the bench hung:\n" + output.decode(errors="replace")[-6000:])
    text = output.decode(errors="replace")
    explain = text[-6000:]
    # exit 1 is an invariant the audit found broken: reported, not this test's concern
    assert proc.returncode in (0, 1), explain
    data = json.loads((tmp_path / "failover.json").read_text())
    assert (tmp_path / "failover.md").read_text().startswith("# Failover bench")
    assert "bench/failover.py --failovers 1" in data["command"]
    assert "SUBMIT_REPLICAS" in data["durable_support"]
    runs = {run["setup"]: run for run in data["runs"]}
    assert sorted(runs) == ["cluster", "sentinel"], explain
    for setup, run in runs.items():
        assert "error" not in run, (setup, run.get("error"))
        (failover,) = run["failovers"]
        assert failover["error"] == "", (setup, failover)
        assert failover["promoted"] not in (None, failover["victim"]), (setup, failover)
        assert failover["revived_after"] > failover["promoted_after"] > 0, (setup, failover)
        assert failover["shards"], (setup, failover)
        if setup == "sentinel":  # one master holds every shard
            assert failover["shards"] == list(range(16))
        # the audit read every acknowledged job
        acked = run["producer"]["acknowledged"]
        assert acked > 50, (setup, run["producer"])
        assert run["audit"]["acknowledged"] == acked
        assert run["producer"]["shard_mismatches"] == 0
        # the recovery was measured, and every response counted by status
        assert run["recovery"]["submits_back"]["n"] == 1, (setup, run["recovery"])
        assert 0 < failover["submits_back"] < 60
        submits = run["responses"]["submit"]
        assert submits["total"] == run["producer"]["attempts"]
        assert submits["by_status"]["2xx"] >= acked
        # a status read after each acknowledged submit (one in flight per sender at the end
        # may be cut short when the load stops)
        ok = submits["by_status"]["2xx"]
        assert ok - 32 <= run["responses"]["read"]["total"] <= ok
