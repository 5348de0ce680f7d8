"""Benchmark: how soon an idle persister writes a burst's first transition, and its idle CPU.

Starts its own Redis and a durable Postgres (fsync on) in temporary folders and runs the
persister in this process, two ways, alternated trial by trial:

* ``waits``: this code. With nothing to read, the persister is blocked in one XREADGROUP
  naming every shard's stream (``Consumer.wait``) and reads an entry as it is written;
* ``naps``: the same persister with that wait taken out (``NappingPersister`` below): it
  naps between polls, from 5 ms doubling to ``NAP_MAX``, as every persister did before.

A trial: the persister idle for a random 0.3 to 0.6 s (long enough to reach its longest nap),
then one job submitted through the real submit script; pickup = the commit of its log entry
(the persister's ``on_commit``, this process's clock) minus the entry's id (Redis's clock,
when the script ran; the same machine's clock). Either way the persister then gathers for
``JOBTIER_PERSIST_INTERVAL`` (50 ms) before writing a batch that is not full: that is in
both. Idle CPU: the persister's (this process, nothing else running in it) and Redis's, per
second over ``--idle`` seconds with nothing to read.

    .venv/bin/python bench/persist_pickup.py              # 40 trials each, 5 s idle each
    .venv/bin/python bench/persist_pickup.py --trials 10 --idle 2

Results: bench/results/persist_pickup.json and bench/results/persist_pickup.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobtier.store.calls import submit_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    environment,
    fmt,
    header_markdown,
    local_redis,
    median,
    percentile,
    redis_cpu,
    save,
    table,
)

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.persist.db import create_pool, migrate
from jobtier.persist.persister import Persister
from jobtier.store.calls import SubmitItem
from jobtier.store.redis import connect
from jobtier.store.scripts import Scripts
from jobtier.streams.entries import LogEntry

SHARDS = 16


class NappingPersister(Persister):
    """The persister without its wait in Redis: idle, it naps between polls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumer.blocking = False


VARIANTS: dict[str, type[Persister]] = {"waits": Persister, "naps": NappingPersister}


async def trial(
    variant: str, settings: Settings, redis: Any, pool: Any, trials: int, idle: float
) -> dict[str, Any]:
    """``trials`` pickups of one variant, then its idle CPU over ``idle`` seconds."""
    keys = Keys(settings.prefix, settings.shards)
    scripts = Scripts(redis, keys)
    committed: dict[bytes, float] = {}
    done = asyncio.Event()

    def on_commit(entries: Sequence[LogEntry], at: float) -> None:
        for e in entries:
            committed[e.entry_id] = at - e.ms / 1000
        done.set()

    persister = VARIANTS[variant](settings, redis, pool, f"bench-{variant}", on_commit=on_commit)
    await persister.consumer.setup()
    task = asyncio.create_task(persister.run())
    pickups: list[float] = []
    try:
        for _ in range(trials):
            await asyncio.sleep(random.uniform(0.3, 0.6))  # idle: the longest nap reached
            done.clear()
            committed.clear()
            shard = random.randrange(SHARDS)
            item = SubmitItem(keys.new_id(shard), "t1", "bench", "normal", b"{}", 3, 0, 0, "", "")
            await scripts.call_many([submit_call(shard, [item], 60_000)])
            await asyncio.wait_for(done.wait(), 30)
            pickups += committed.values()
        await asyncio.sleep(0.5)  # the last acknowledgement and trim
        cpu0, redis0, t0 = time.process_time(), await redis_cpu(redis), time.monotonic()
        await asyncio.sleep(idle)
        seconds = time.monotonic() - t0
        cpu, redis_used = time.process_time() - cpu0, await redis_cpu(redis) - redis0
    finally:
        persister.stop()
        await asyncio.wait_for(task, 30)
    return {
        "pickups_ms": [round(1000 * p, 2) for p in pickups],
        "idle_persister_ms_per_s": 1000 * cpu / seconds,
        "idle_redis_ms_per_s": 1000 * redis_used / seconds,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()
    pg = LocalPostgres(Path(tempfile.mkdtemp(prefix="jobtier-bench-pg-")), durable=True)
    got: dict[str, dict[str, Any]] = {
        v: {"pickups_ms": [], "idle_persister_ms_per_s": [], "idle_redis_ms_per_s": []}
        for v in VARIANTS
    }
    with local_redis() as server:
        try:
            pg.start()
            await migrate(pg.dsn)
            pool = await create_pool(pg.dsn, max_size=4)
            settings = Settings.from_env(
                {}, redis_url=server.url, database_url=pg.dsn, shards=SHARDS
            )
            redis = connect(settings)
            order = list(VARIANTS)
            for r in range(args.rounds):  # alternated rounds: the machine's load drifts
                for variant in order if r % 2 == 0 else order[::-1]:
                    one = await trial(variant, settings, redis, pool, args.trials, args.idle)
                    for key, value in one.items():
                        if key == "pickups_ms":
                            got[variant][key] += value
                        else:
                            got[variant][key].append(value)
                    print(
                        f"round {r + 1} {variant}: pickup p50 {median(one['pickups_ms']):.1f} "
                        f"ms, idle persister {one['idle_persister_ms_per_s']:.2f} ms/s, "
                        f"Redis {one['idle_redis_ms_per_s']:.2f} ms/s",
                        flush=True,
                    )
            await redis.aclose()
            await pool.close()
        finally:
            pg.destroy()
    summary = {
        v: {
            "trials": len(g["pickups_ms"]),
            **{f"pickup_p{q}_ms": percentile(g["pickups_ms"], q) for q in (50, 90, 99)},
            "pickup_max_ms": max(g["pickups_ms"]),
            "idle_persister_ms_per_s": median(g["idle_persister_ms_per_s"]),
            "idle_redis_ms_per_s": median(g["idle_redis_ms_per_s"]),
        }
        for v, g in got.items()
    }
    return {**env, "arguments": vars(args), "summary": summary, "samples": got}


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    rows = [
        [
            f"**{v}**" if v == "waits" else v,
            str(x["trials"]),
            *(fmt(x[f"pickup_p{q}_ms"], 1) for q in (50, 90, 99)),
            fmt(x["pickup_max_ms"], 1),
            fmt(x["idle_persister_ms_per_s"], 2),
            fmt(x["idle_redis_ms_per_s"], 2),
        ]
        for v, x in s.items()
    ]
    a = result["arguments"]
    headers = [
        "persister", "trials", "pickup p50 ms", "p90 ms", "p99 ms", "max ms",
        "idle CPU, persister ms/s", "idle CPU, Redis ms/s",
    ]  # fmt: skip
    return (
        header_markdown("Persister: pickup after idle, and idle CPU", result)
        + "\n"
        + f"{a['rounds']} alternated rounds of {a['trials']} trials per variant; idle CPU "
        f"over {a['idle']:g} s per round (medians of the rounds). Pickup: a lone job's "
        "submit entry from its id (Redis's clock) to its commit, the persister idle before "
        "it; both include the 50 ms a persister gathers before writing a batch that is not "
        "full. `waits`: this code (blocked in one XREADGROUP over every stream while idle); "
        "`naps`: the same without that wait, napping up to 100 ms between polls.\n\n"
        + table(headers, rows)
        + "\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="pickups per variant per round (20)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds (2)")
    p.add_argument("--idle", type=float, default=5.0, help="idle seconds measured a round (5)")
    p.add_argument("--no-save", action="store_true", help="print only")
    args = p.parse_args()
    result = asyncio.run(bench(args))
    text = report(result)
    print(text)
    if not args.no_save:
        for path in save("persist_pickup", result, text):
            print(f"saved {path}")


if __name__ == "__main__":
    main()
