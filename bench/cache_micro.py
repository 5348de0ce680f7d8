"""Microbenchmark: what one status read costs in the read path's parts, in this process.

No HTTP: this measures the Python cost per request of the near cache, the coalescer and the
Redis loads, against the plain baseline (one Redis call per request) measured in the same run.
Starts its own Redis in a temporary folder.

    .venv/bin/python bench/cache_micro.py                   # uvloop when installed
    .venv/bin/python bench/cache_micro.py --asyncio --out /tmp/micro.json

Columns: wall time and this process's CPU time per request (or per event), medians of
``--runs`` runs. Results go to ``--out`` (bench/results/cache_micro.json by default).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis

from jobtier.core.keys import Keys
from jobtier.dev.local_redis import LocalRedis
from jobtier.status.coalescer import Coalescer
from jobtier.status.nearcache import Entry, NearCache
from jobtier.status.reader import StatusReader

SHARDS = 16
DOC = (
    b'{"id":"%s","type":"resize","queue":"default","state":"running","version":3,'
    b'"priority":"normal",'
    b'"attempt":1,"max_attempts":3,"created_at":"2026-11-29T12:00:00.000Z",'
    b'"updated_at":"2026-11-29T12:00:01.000Z","run_at":null,"progress":{"pct":40},'
    b'"error":null,"cancel_requested":false,"worker":"w-1"}'
)
Case = Callable[[], Awaitable[int]]  # runs once, returns how many requests/events it made


def measure(case: Case, runs: int) -> tuple[float, float]:
    """(wall ns, CPU ns) per request, medians over runs (after one warm-up)."""
    loop = asyncio.get_event_loop()
    loop.run_until_complete(case())
    walls, cpus = [], []
    for _ in range(runs):
        gc.collect()
        w0, c0 = time.perf_counter_ns(), time.process_time_ns()
        n = loop.run_until_complete(case())
        walls.append((time.perf_counter_ns() - w0) / n)
        cpus.append((time.process_time_ns() - c0) / n)
    return statistics.median(walls), statistics.median(cpus)


# --- pure Python: no I/O ------------------------------------------------------------------
def cpu_cases(keys: Keys) -> dict[str, Case]:
    ids = [keys.new_id(i % SHARDS) for i in range(1000)]
    hot = ids[0]
    cache = NearCache(100_000, ttl=3600)
    reader = StatusReader(None, keys, ttl=3600)  # type: ignore[arg-type]  # hits only
    assert reader.near is not None
    for job_id in ids:
        entry = Entry("acme", 3, DOC % job_id.encode(), time.monotonic())
        cache.put(job_id, entry)
        reader.near.put(job_id, entry)
    event = b"%s 4 acme\n%s" % (hot.encode(), DOC % hot.encode())
    absent = keys.new_id(1)
    absent_event = b"%s 4 acme\n%s" % (absent.encode(), DOC % absent.encode())
    n = 200_000

    async def near_get() -> int:
        get, now = cache.get, time.monotonic()
        for _ in range(n):
            get(hot, now)
        return n

    async def reader_hit() -> int:
        get = reader.get
        for _ in range(n):
            await get(hot)
        return n

    async def reader_hit_spread() -> int:
        get = reader.get
        for i in range(n):
            await get(ids[i % 1000])
        return n

    async def event_present() -> int:
        on_event = reader.on_event
        for _ in range(n):
            on_event(b"jt:{1}:ev", event)
        return n

    async def event_absent() -> int:
        on_event = reader.on_event
        for _ in range(n):
            on_event(b"jt:{1}:ev", absent_event)
        return n

    async def instant(batch: list[str]) -> dict[str, int]:
        return dict.fromkeys(batch, 1)

    coalescer: Coalescer[str, int] = Coalescer(instant)

    async def coalesce_hot() -> int:  # 1,000 waiters of one key, machinery only
        await asyncio.gather(*(coalescer.get(hot) for _ in range(1000)))
        return 1000

    async def coalesce_spread() -> int:  # 1,000 distinct keys in one tick (2 batches)
        await asyncio.gather(*(coalescer.get(i) for i in ids))
        return 1000

    async def noop() -> None:
        return None

    async def harness() -> int:  # what gather() itself costs per request: a task each
        await asyncio.gather(*(noop() for _ in range(1000)))
        return 1000

    return {
        "NearCache.get hit": near_get,
        "StatusReader.get hit (one key)": reader_hit,
        "StatusReader.get hit (1,000 keys)": reader_hit_spread,
        "on_event, id cached": event_present,
        "on_event, id not cached": event_absent,
        "Coalescer, 1,000 waiters of one key (fake load)": coalesce_hot,
        "Coalescer, 1,000 keys in one tick (fake load)": coalesce_spread,
        "(harness: gather of 1,000 no-op coroutines)": harness,
    }


# --- against Redis ---------------------------------------------------------------------------
def redis_cases(redis: Redis, keys: Keys, ids: list[str]) -> dict[str, Case]:
    hot = ids[0]

    def reader(**kw: Any) -> StatusReader:
        return StatusReader(redis, keys, **kw)

    def concurrent(r: StatusReader, batch: list[str]) -> Case:
        async def run() -> int:
            results = await asyncio.gather(*(r.get(i) for i in batch))
            assert all(results)
            return len(batch)

        return run

    coalesced = reader(near_cache=False, coalesce=True)
    plain = reader(near_cache=False, coalesce=False)

    async def baseline_sequential() -> int:
        for i in ids[:500]:
            await plain.get(i)
        return 500

    return {
        "coalesced miss, 500 ids in one tick": concurrent(coalesced, ids[:500]),
        "coalesced miss, 50 ids in one tick": concurrent(coalesced, ids[:50]),
        "coalesced miss, 1,000 gets of one id": concurrent(coalesced, [hot] * 1000),
        "baseline: one Redis call per get, 500 concurrent ids": concurrent(plain, ids[:500]),
        "baseline: one Redis call per get, 1,000 gets of one id": concurrent(plain, [hot] * 1000),
        "baseline: one Redis call per get, sequential": baseline_sequential,
    }


async def fill(redis: Redis, keys: Keys, n: int) -> list[str]:
    ids = [keys.new_id(i % SHARDS) for i in range(n)]
    pipe = redis.pipeline(transaction=False)
    # the hash submit and claim leave for DOC (core/keys.py, "Job hashes"): read_status.lua
    # renders DOC from it
    updated = 1_795_953_601_000  # 2026-11-29T12:00:01.000Z
    c = "resize normal 3 2026-11-29T12:00:00.000Z default "
    t = f"running 3 1 {updated}   0 1 2 {updated} w-1"
    for job_id in ids:
        pipe.hset(
            keys.job(job_id),
            mapping={"tenant": "acme", "id": job_id, "c": c, "t": t, "progress": '{"pct":40}'},
        )
    await pipe.execute()
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--asyncio", action="store_true", help="plain asyncio, not uvloop")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "cache_micro.json"
    )
    args = parser.parse_args()
    loop_name = "asyncio"
    if not args.asyncio:
        try:
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
            loop_name = "uvloop"
        except ImportError:
            pass
    asyncio.set_event_loop(asyncio.new_event_loop())
    loop = asyncio.get_event_loop()
    keys = Keys("jt", SHARDS)

    rows: list[tuple[str, float, float]] = []
    for name, case in cpu_cases(keys).items():
        rows.append((name, *measure(case, args.runs)))

    with tempfile.TemporaryDirectory() as folder:
        server = LocalRedis(Path(folder)).start()
        try:
            pool = BlockingConnectionPool.from_url(server.url, max_connections=64)
            redis = Redis.from_pool(pool)
            ids = loop.run_until_complete(fill(redis, keys, 1000))
            for name, case in redis_cases(redis, keys, ids).items():
                rows.append((name, *measure(case, args.runs)))
            loop.run_until_complete(redis.aclose())
        finally:
            server.stop()

    print(
        f"\nread path parts, {loop_name}, Python {platform.python_version()}, median of {args.runs}"
    )
    print(f"{'case':<52} {'wall/req':>12} {'CPU/req':>12}")
    for name, wall, cpu in rows:
        print(f"{name:<52} {fmt(wall):>12} {fmt(cpu):>12}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "loop": loop_name,
                "python": platform.python_version(),
                "platform": platform.platform(),
                "runs": args.runs,
                "ns_per_request": {name: {"wall": w, "cpu": c} for name, w, c in rows},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nsaved to {args.out}", file=sys.stderr)


def fmt(ns: float) -> str:
    return f"{ns:,.0f} ns" if ns < 10_000 else f"{ns / 1000:,.1f} us"


if __name__ == "__main__":
    main()
