"""Benchmark: what one ``ctx.checkpoint`` save costs Redis, against a plain heartbeat and a
logged progress report measured in the same run.

Starts its own Redis (AOF on, as jobtier requires). Jobs are submitted and claimed once,
then one script call per job is timed, one at a time (what a task's ``await`` waits for),
cell after cell in turn for ``--rounds`` rounds so that the machine's load falls on every
cell alike:

* ``heartbeat`` (baseline): the heartbeat script extending one job's lease;
* ``progress (logged)``: the same beat carrying a new progress value, logged to the history
  (``JOBTIER_PROGRESS_HISTORY_SECONDS=0``): the nearest existing kind of write;
* ``checkpoint N B``: the beat carrying a checkpoint state of N bytes (saved in the job
  hash, logged with its state for Postgres).

Figures per call: the round trip's median (µs, client clock), Redis CPU (INFO cpu) and the
bytes Redis wrote to files (the AOF), and each cell's median round trip as a ratio of the
heartbeat's in the same round, then the median ratio over the rounds.

    .venv/bin/python bench/checkpoint.py              # 7 rounds of 300 calls per cell
    .venv/bin/python bench/checkpoint.py --quick

Results: bench/results/checkpoint.json and bench/results/checkpoint.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RedisMeter, environment, fmt, header_markdown, local_redis, save, table

from jobtier.config import Settings
from jobtier.core.errors import Code
from jobtier.core.model import JobSpec
from jobtier.engine.queue import Queue
from jobtier.store.calls import claim_call, heartbeat_call, parse_claim, parse_pairs

WORKER = "bench-worker"
LEASE_MS = 600_000
SIZES = (100, 4096, 65536)


def state_of(size: int, n: int) -> bytes:
    """A JSON string of ``size`` bytes, different for each call (a new state each time)."""
    head = b'"%d:' % n
    return head + b"x" * (size - len(head) - 1) + b'"'


async def claim_all(queue: Queue, n: int) -> list[tuple[int, str, int]]:
    """Submit and claim ``n`` jobs: (shard, id, lease version) each."""
    await queue.submit_many([JobSpec(type="bench") for _ in range(n)])
    held = []
    for shard in range(queue.keys.shards):
        while True:
            reply = await queue.scripts.call(*claim_call(shard, WORKER, 100, LEASE_MS))
            batch = parse_claim(shard, reply)
            held += [(shard, j.id, j.lease_version) for j in batch.jobs]
            if not batch.jobs:
                break
    assert len(held) == n, len(held)
    return held


async def run_cell(
    queue: Queue, meter: RedisMeter, held: list[tuple[int, str, int]], cell: str, serial: int
) -> dict[str, Any]:
    times = []
    await meter.start()
    for i, (shard, job_id, lease) in enumerate(held):
        n = serial + i
        progress, checkpoints = b"", ()
        if cell == "progress (logged)":
            progress = b'{"done":%d}' % n
        elif cell.startswith("checkpoint"):
            checkpoints = ((0, state_of(int(cell.split()[1]), n)),)  # type: ignore[assignment]
        call = heartbeat_call(shard, WORKER, LEASE_MS, [(job_id, lease, progress)], 0, checkpoints)
        t0 = time.perf_counter()
        reply = await queue.scripts.call(*call)
        times.append(time.perf_counter() - t0)
        assert parse_pairs(reply)[0][0] is Code.OK
    redis = await meter.stop(len(held))
    # the log streams would grow by every state: trimmed between cells (not measured)
    for shard in range(queue.keys.shards):
        await queue.redis.xtrim(queue.keys.log(shard), maxlen=0)
    return {
        "median_us": 1e6 * statistics.median(times),
        "redis_cpu_us": redis["redis_cpu_us_per_job"],
        "aof_bytes": redis["aof_bytes_per_job"],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300, help="calls per cell per round")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 100 calls")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.calls = 2, 100
    cells = ["heartbeat", "progress (logged)", *(f"checkpoint {s} B" for s in SIZES)]
    env = environment()
    rounds: list[dict[str, dict[str, Any]]] = []
    with local_redis(aof=True) as server:
        settings = Settings.from_env({}, redis_url=server.url, shards=4)
        async with await Queue.connect(settings, catalog=False) as queue:
            held = await claim_all(queue, args.calls)
            meter = RedisMeter(queue.redis, server.pid)  # type: ignore[arg-type]
            for r in range(args.rounds):
                out = {}
                for c in cells:
                    out[c] = await run_cell(queue, meter, held, c, r * 1_000_000)
                rounds.append(out)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    summary = {}
    for c in cells:
        ratios = [rd[c]["median_us"] / rd["heartbeat"]["median_us"] for rd in rounds]
        summary[c] = {
            "median_us": statistics.median(rd[c]["median_us"] for rd in rounds),
            "redis_cpu_us": statistics.median(rd[c]["redis_cpu_us"] for rd in rounds),
            "aof_bytes": statistics.median(rd[c]["aof_bytes"] for rd in rounds),
            "ratio_to_heartbeat": statistics.median(ratios),
            "ratios": ratios,
        }
    headers = ["call", "round trip µs (median)", "ratio to heartbeat", "Redis CPU µs", "AOF bytes"]
    rows = [
        [
            c,
            fmt(s["median_us"]),
            fmt(s["ratio_to_heartbeat"], 2),
            fmt(s["redis_cpu_us"], 1),
            fmt(s["aof_bytes"]),
        ]
        for c, s in summary.items()
    ]
    text = table(headers, rows)
    print(text)
    load = env["machine"]["load_average_at_start"]
    md = (
        header_markdown("Checkpoint saves against a heartbeat", env)
        + f"- {args.rounds} rounds of {args.calls} calls per cell, one call at a time, cells "
        "in turn; medians over the rounds (ratios: per round, against that round's heartbeat)\n"
        f"- the machine is shared and was loaded (load average {load[0]} at start on "
        f"{env['machine']['nproc']} CPUs): absolute figures move from run to run, the "
        "ratios less so\n\n"
        + text
        + "\n\nA save is a heartbeat that also writes the state to the job hash and logs a "
        "transition carrying it: the AOF takes the state twice (hash and stream), so the "
        "bytes written grow with the state, and a 64 KiB state costs far more than a small "
        "cursor. Save a cursor, once per chunk of work.\n"
    )
    data = {"env": env, "rounds": rounds, "summary": summary, "args": vars(args)}
    json_path, md_path = save("checkpoint", data, md)
    print(f"saved {json_path} and {md_path}")


if __name__ == "__main__":
    asyncio.run(main())
