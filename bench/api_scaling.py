"""Benchmark: API processes, one or two on this machine, and what more would give.

Two parts:

* measured here, in this process: the CPU one API process spends on each status event its
  subscriptions deliver (``StatusReader.on_event``; every process receives every event of
  every shard, whatever it serves), for a job it does not cache and for one it does;
* read from ``bench/results/status_read.json`` (run it first, with the ``jobtier`` and
  ``jobtier-2w`` configurations): requests/s, p99 and API CPU per request of one and of two
  server processes on this 2-core machine.

From those it extrapolates a host of ``--cores`` cores serving only API processes (Redis
elsewhere): per process, a core's second less the events' share (``--transitions`` a second,
all shards) divided by the CPU per request of each mix. A projection from per-request CPU,
not a measurement: it assumes requests spread evenly and no other bottleneck (the network,
Redis's capacity for the misses — given per mix too).

    .venv/bin/python bench/api_scaling.py
    .venv/bin/python bench/api_scaling.py --cores 16 --transitions 27000

Results: bench/results/api_scaling.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment, fmt, header_markdown, median, save, table

from jobtier.core.keys import Keys
from jobtier.status.reader import StatusReader

DOC = (
    b'{"id":"%s","type":"resize_image","queue":"default","state":"running","version":%d,'
    b'"priority":"normal","attempt":1,"max_attempts":3,"created_at":"2026-11-29T12:00:00.000Z",'
    b'"updated_at":"2026-11-29T12:00:01.250Z","run_at":null,"progress":null,"error":null,'
    b'"cancel_requested":false,"worker":"host-1:4242"}'
)


def event_cost(n: int, cached: bool) -> float:
    """CPU µs this process spends per status event: a real Redis publishes ``n`` events
    (SPUBLISH, from another process) on one shard channel; this process receives them through
    a ``ShardSubscriber`` into ``StatusReader.on_event``, as an API process does. Median of 3
    rounds."""
    import asyncio
    import tempfile

    from jobtier.dev.local_redis import LocalRedis
    from jobtier.store.subscriber import ShardSubscriber

    keys = Keys("jt", 16)
    ids = [keys.new_id(0) for _ in range(1000)]

    async def run(url: str) -> list[float]:
        from redis.asyncio import Redis

        redis = Redis.from_url(url)
        reader = StatusReader(redis, keys)
        reader.events_live = lambda: True
        if cached:
            assert reader.near is not None
            from jobtier.status.nearcache import Entry

            for job_id in ids:
                doc = DOC % (job_id.encode(), 1)
                reader.near.put(job_id, Entry("t1", 1, doc, time.monotonic()))
        got = [0]
        inner = reader.on_event

        def counted(channel: bytes, data: bytes) -> None:
            got[0] += 1
            inner(channel, data)

        sub = ShardSubscriber(redis, [keys.events(0)], counted, reader.on_reset, name="bench")
        await sub.start()
        rounds = []
        try:
            for r in range(3):
                got[0] = 0
                t0 = time.process_time()
                pub = await asyncio.create_subprocess_exec(
                    sys.executable, __file__, "--publish", url, str(n), str(r)
                )
                while got[0] < n:
                    await asyncio.sleep(0.005)
                rounds.append((time.process_time() - t0) / n * 1e6)
                await pub.wait()
        finally:
            await sub.stop()
            await redis.aclose()
        return rounds

    with tempfile.TemporaryDirectory(prefix="jobtier-bench-") as folder:
        server = LocalRedis(Path(folder)).start()
        try:
            return median(asyncio.run(run(server.url)))
        finally:
            server.stop()


def publish(url: str, n: int, round_: int) -> None:
    """(child) SPUBLISH ``n`` status events on shard 0's channel, versions above any before."""
    import redis

    keys = Keys("jt", 16)
    r = redis.Redis.from_url(url)
    ids = [keys.new_id(0) for _ in range(1000)]
    base = 2 + round_ * (n // 1000 + 2)
    for start in range(0, n, 1000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + 1000)):
            v = base + i // 1000
            job = ids[i % 1000].encode()
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "SPUBLISH", keys.events(0), b"%s %d t1\n" % (job, v) + DOC % (job, v)
            )
        pipe.execute()
    r.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cores", type=int, default=16)
    p.add_argument(
        "--transitions",
        type=float,
        default=27_000,
        help="status events a second (27000: 9K jobs/s)",
    )
    p.add_argument("--events", type=int, default=50_000, help="events per round (50000)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--publish", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.publish:
        publish(args.publish[0], int(args.publish[1]), int(args.publish[2]))
        return
    env = environment()
    absent = event_cost(args.events, cached=False)
    present = event_cost(args.events, cached=True)
    data: dict[str, Any] = {"event_us_absent": absent, "event_us_cached": present}
    md = header_markdown("API processes: one, two, and a projection to more cores", env)
    md += "\n## Status events: CPU per event in one API process (measured here: a real Redis publishes, a ShardSubscriber receives into StatusReader.on_event)\n\n"
    md += table(
        ["event for", "µs of CPU"],
        [["a job the process does not cache (most)", fmt(absent, 2)],
         ["a cached job (the entry advances)", fmt(present, 2)]],
    ) + "\n"  # fmt: skip
    source = RESULTS / "status_read.json"
    rows: list[list[str]] = []
    proj: list[list[str]] = []
    if source.exists():
        saved = json.loads(source.read_text())
        summary = saved.get("summary", [])
        md += (
            f"\n## One and two API processes on this machine (from `{source.name}`, "
            f"{saved.get('environment', {}).get('date', '?')}, commit "
            f"{saved.get('environment', {}).get('commit', '?')})\n\n"
        )
        cells = {(s["config"], s["mix"], s["mode"]): s for s in summary}
        for mix in ("hot", "spread", "churn"):
            for mode in ("closed", "open20k"):
                one = cells.get(("jobtier", mix, mode))
                two = cells.get(("jobtier-2w", mix, mode))
                if one is None and two is None:
                    continue
                rows.append([
                    mix, mode,
                    *(["-"] * 3 if one is None else [fmt(one["rps"]), fmt(one["p99"], 2),
                                                     fmt(one["server_cpu_us_per_req"], 1)]),
                    *(["-"] * 3 if two is None else [fmt(two["rps"]), fmt(two["p99"], 2),
                                                     fmt(two["server_cpu_us_per_req"], 1)]),
                ])  # fmt: skip
        md += table(
            ["mix", "mode", "1 process: req/s", "p99 ms", "CPU µs/req", "2 processes: req/s",
             "p99 ms", "CPU µs/req"],
            rows,
        ) + "\n"  # fmt: skip
        md += (
            "\nOn 2 cores the two processes share them with Redis, the load generator and "
            "other work: what two processes show here is that nothing is lost between them "
            "(each has its own near cache and subscriptions), not how far they scale.\n"
        )
        events_share = args.transitions * absent / 1e6
        for mix in ("hot", "spread", "churn"):
            one = cells.get(("jobtier", mix, "closed"))
            if one is None or not one["server_cpu_us_per_req"]:
                continue
            per_req = one["server_cpu_us_per_req"]
            per_process = (1 - events_share) * 1e6 / per_req
            host = per_process * args.cores
            misses = host * one["sent_cmds_per_req"]
            proj.append([
                mix, fmt(per_req, 1), f"{events_share:.1%}", fmt(per_process), fmt(host),
                fmt(host * one["redis_cmds_per_req"]), fmt(misses),
            ])  # fmt: skip
        md += (
            f"\n## Projection: {args.cores} cores of API processes, {args.transitions:,.0f} "
            "status events a second\n\n"
        )
        md += table(
            ["mix", "CPU µs/req (1 process, closed)", "events' share of a core",
             "req/s per process", f"req/s, {args.cores} processes", "Redis commands/s",
             "Redis round trips/s"],
            proj,
        ) + "\n"  # fmt: skip
        md += (
            "\nEach process holds one subscription per Redis node and handles every event: "
            f"at {args.transitions:,.0f} events a second that is the share above of each "
            "core, whatever the process serves; Redis sends each event once per subscribed "
            "process (its fan-out grows with the process count). Misses go to Redis: the "
            "commands a second in the table (inside its read script) are what a single Redis "
            "node would have to answer; past one node's capacity, a Redis Cluster spreads "
            "them with the shards.\n"
        )
    data.update(table_one_two=rows, projection=proj, args=vars(args))
    print(md)
    if not args.no_save:
        save("api_scaling", {"environment": env, **data}, md)


if __name__ == "__main__":
    main()
