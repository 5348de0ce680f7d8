"""bench/failover.py's accounting, on made-up responses: where a failure is placed (the lost
master's shards or the others) and when submits count as back after a kill. Run in a fresh
interpreter with bench/ on its path, so no bench module shadows an import of the test run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"

CHECK = """
from failover import Failover, Reply, first_submit_back, status_counts

# a kill at t=10 of the master of shards 1 and 2, another at t=30 of the master of shard 3
first = Failover(1, 7001, [1, 2], 10.0, 0.0, 10.0)
second = Failover(2, 7002, [3], 30.0, 0.0, 30.0)
replies = [
    Reply("submit", 1.0, 1.1, 202, False, 1, "J1"),  # before any kill
    Reply("submit", 2.0, 2.1, 503, True, 1),  # a failure before any kill: other shards
    Reply("submit", 9.9, 10.2, 500, False, 1),  # sent before the kill, answered after: lost
    Reply("submit", 11.0, 11.1, 503, True, 2),  # lost master's shard
    Reply("submit", 11.0, 11.2, 503, True, 5),  # another shard, same time
    Reply("read", 11.5, 11.6, 503, False, 5),
    Reply("submit", 9.0, 14.0, 202, False, 2, "J2"),  # held through the kill: sent before it
    Reply("submit", 12.0, 15.5, 202, False, 2, "J3"),  # the first sent after the kill
    Reply("submit", 13.0, 16.0, 202, False, 5, "J4"),  # another shard: not a recovery
    Reply("submit", 29.0, 31.0, 0, False, 1),  # after the second kill, not its shard: other
    Reply("submit", 31.0, 32.0, 429, False, 3),  # a 4xx is not a failure to place
]
assert first_submit_back(replies, first, float("inf")) == 5.5
assert first_submit_back(replies, first, 12.0) is None  # none sent before the next kill
assert first_submit_back(replies, second, float("inf")) is None

counts = status_counts(replies, [first, second])
submit, read = counts["submit"], counts["read"]
assert submit["total"] == 10 and read["total"] == 1, counts
assert submit["by_status"] == {
    "2xx": 4, "503 with Retry-After": 3, "other 5xx": 1, "no answer": 1, "429": 1
}, submit
assert submit["failures"] == {
    "503 with Retry-After": {"other shards": 2, "lost master's shards": 1},
    "other 5xx": {"lost master's shards": 1},
    "no answer": {"other shards": 1},
}, submit["failures"]
assert read["failures"] == {"503 without Retry-After": {"other shards": 1}}, read
print("ok")
"""


def test_failures_are_placed_by_shard_and_recovery_counts_submits_sent_after_the_kill() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=BENCH, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
