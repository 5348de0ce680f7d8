"""Benchmark: what a debounce or throttle key adds to a submit (docs/debounce-throttle.md).

Starts its own Redis (AOF on, appendfsync everysec). One producer (``Queue.submit``, one
submit at a time, the script the API's submit route runs) sends, in each round, a block of
each case in turn, so every case meets the same load of a shared machine:

* ``plain``: no key (the baseline, submit.lua);
* ``debounce new``: a debounce key not seen before (keyed.lua creates the job and the key);
* ``debounce replace``: the same key again (keyed.lua rewrites the pending job);
* ``throttle admit``: a throttle key with room (keyed.lua takes a slot, creates the job);
* ``throttle delay``: a full key with ``on_limit: delay`` (a slot in the future);
* ``throttle refuse``: a full key with ``on_limit: refuse`` (nothing is made).

Per case: the submit's latency as the producer sees it (median, p99), and Redis's own time
per call (INFO commandstats: FCALL's usec over its calls in that block), each as the median
over the rounds, and its ratio to ``plain`` measured in the same rounds.

    .venv/bin/python bench/debounce.py            # 6 rounds of 400 submits per case
    .venv/bin/python bench/debounce.py --quick

Results: bench/results/debounce.json and bench/results/debounce.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, fmt, header_markdown, local_redis, median, percentile, save, table

from jobtier.config import Settings
from jobtier.core.debounce import Throttled
from jobtier.engine.queue import Queue

CASES = (
    "plain",
    "debounce new",
    "debounce replace",
    "throttle admit",
    "throttle delay",
    "throttle refuse",
)


def submitter(queue: Queue, case: str, round_: int) -> Callable[[int], Awaitable[Any]]:
    """The submit of ``case`` for sample ``i`` of round ``round_`` (keys fresh per round)."""
    r = f"r{round_}"
    big = 10_000  # more than a block's samples: every submit finds room

    async def send(i: int) -> Any:
        if case == "plain":
            return await queue.submit("echo", i)
        if case == "debounce new":
            return await queue.submit("echo", i, debounce={"key": f"{r}-{i}", "seconds": 3600})
        if case == "debounce replace":
            return await queue.submit("echo", i, debounce={"key": f"{r}-same", "seconds": 3600})
        if case == "throttle admit":
            option = {"key": f"{r}-admit", "limit": big, "period": 3600}
            return await queue.submit("echo", i, throttle=option)
        if case == "throttle delay":
            option = {"key": f"{r}-delay", "limit": 1, "period": 1, "on_limit": "delay"}
            return await queue.submit("echo", i, throttle=option)
        try:
            option = {"key": f"{r}-refuse", "limit": 1, "period": 3600}
            return await queue.submit("echo", i, throttle=option)
        except Throttled:
            return None

    return send


async def fcall_stats(queue: Queue) -> tuple[int, int]:
    """(calls, usec) of FCALL so far."""
    info = await queue.redis.info("commandstats")
    stat = info.get("cmdstat_fcall", {})
    return int(stat.get("calls", 0)), int(stat.get("usec", 0))


async def block(queue: Queue, case: str, round_: int, n: int) -> dict[str, Any]:
    send = submitter(queue, case, round_)
    await send(-1)  # the key exists before the clock starts (replace, refuse: as steady)
    calls0, usec0 = await fcall_stats(queue)
    latencies = []
    for i in range(n):
        start = time.perf_counter()
        await send(i)
        latencies.append(1e6 * (time.perf_counter() - start))
    calls1, usec1 = await fcall_stats(queue)
    # the block's figures, not its samples: the results file stays small
    return {
        "n": n,
        "p50_us": median(latencies),
        "p99_us": percentile(latencies, 99),
        "redis_us_per_call": (usec1 - usec0) / max(1, calls1 - calls0),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with local_redis(aof=True) as server:
        settings = Settings.from_env({}, redis_url=server.url, shards=args.shards)
        async with await Queue.connect(settings, catalog=False) as queue:
            await block(queue, "plain", -1, 200)  # warm up: connections, the library
            rounds: list[dict[str, Any]] = []
            for round_ in range(args.rounds):
                # each round starts with another case: none is always first after a pause
                order = CASES[round_ % len(CASES) :] + CASES[: round_ % len(CASES)]
                got = {case: await block(queue, case, round_, args.samples) for case in order}
                rounds.append({case: got[case] for case in CASES})
    return {"rounds": rounds}


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        per_round = [r[case] for r in raw["rounds"]]
        base = [r["plain"] for r in raw["rounds"]]
        p50 = [b["p50_us"] for b in per_round]
        p99 = [b["p99_us"] for b in per_round]
        server = [b["redis_us_per_call"] for b in per_round]
        ratio = [b["p50_us"] / p["p50_us"] for b, p in zip(per_round, base, strict=True)]
        server_ratio = [
            b["redis_us_per_call"] / p["redis_us_per_call"]
            for b, p in zip(per_round, base, strict=True)
        ]
        out[case] = {
            "p50_us": median(p50),
            "p99_us": median(p99),
            "redis_us_per_call": median(server),
            "latency_ratio": median(ratio),
            "latency_ratios": ratio,
            "redis_ratio": median(server_ratio),
            "redis_ratios": server_ratio,
        }
    return out


def spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def render(s: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    out = [header_markdown("Debounce and throttle: the cost a key adds to a submit", env)]
    out.append(
        f"One producer, one `Queue.submit` at a time, {args.shards} shards, Redis with AOF on "
        f"(everysec). {args.rounds} rounds; in each, {args.samples} submits of every case in "
        "turn, so each case meets the same load. Figures are the median over the rounds of "
        "each round's figure; a ratio is the case's over `plain` in the same round, median "
        "over rounds (each round's ratio in the JSON). *Redis µs/call*: FCALL's time in Redis "
        "(INFO commandstats) over its calls in the block. The machine is shared and was "
        "loaded by other work while this ran (the load average above): the absolute figures "
        "carry that noise; the ratios, measured side by side, are the result, and their "
        "spread over the rounds (min-max) shows how far to trust them: a ratio below 1 is "
        "that noise, not a keyed submit being cheaper.\n"
    )
    rows = []
    for case in CASES:
        m = s[case]
        rows.append([
            case, fmt(m["p50_us"]), fmt(m["p99_us"]), fmt(m["latency_ratio"], 2) + "x",
            spread(m["latency_ratios"]), fmt(m["redis_us_per_call"], 1),
            fmt(m["redis_ratio"], 2) + "x", spread(m["redis_ratios"]),
        ])  # fmt: skip
    headers = [
        "case", "p50 µs", "p99 µs", "p50 / plain", "(min-max)", "Redis µs/call",
        "Redis / plain", "(min-max)",
    ]  # fmt: skip
    out.append(table(headers, rows) + "\n")
    new, replace = s["debounce new"], s["debounce replace"]
    out.append(
        f"A debounced submit costs {new['latency_ratio']:.2f}x a plain one end to end when it "
        f"creates the job and {replace['latency_ratio']:.2f}x when it replaces the pending "
        f"one; in Redis, {new['redis_ratio']:.2f}x and {replace['redis_ratio']:.2f}x. A "
        f"throttled submit that is admitted costs {s['throttle admit']['latency_ratio']:.2f}x; "
        f"one refused, {s['throttle refuse']['latency_ratio']:.2f}x (it writes nothing).\n"
    )
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds of every case (6)")
    p.add_argument("--samples", type=int, default=400, help="submits per case per round (400)")
    p.add_argument("--shards", type=int, default=16, help="logical shards (16)")
    p.add_argument("--quick", action="store_true", help="3 rounds of 100")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.samples = min(args.rounds, 3), min(args.samples, 100)
    return args


def run(argv: list[str] | None = None) -> None:
    import uvloop

    args = parse(argv)
    env = environment()
    raw = uvloop.run(main(args))
    summary = summarise(raw)
    text = render(summary, args, env)
    print(text)
    if not args.no_save:
        paths = save(
            "debounce", {**env, "arguments": vars(args), "summary": summary, "raw": raw}, text
        )
        print(f"\nsaved {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    run()
