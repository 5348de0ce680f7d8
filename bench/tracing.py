"""Benchmark: what OpenTelemetry tracing costs per job, on against off, in one run.

Starts its own Redis (AOF on, ``noeviction``) and, in this one process, runs rounds of: submit
N jobs (``Queue.submit``, 50 in flight, each its own request), then a ``Worker``
(concurrency 50, burst) drains them. The two modes alternate round by round:

* off: no tracer provider (jobtier's tracing is off: what every job pays is a cheap check);
* on: jobtier traces with an SDK TracerProvider (``tracing.install``) whose spans go through a
  ``BatchSpanProcessor`` to an exporter that drops them (the SDK's work and ours, not the
  network's). Each submit runs inside a sampled span context of its own (a remote parent, as
  an API request's traceparent gives; creating it costs next to nothing), so every job keeps
  a traceparent and its attempt is a span.

Figures per job, medians over the rounds: this process's CPU µs for the submits and for the
worker's part (the exporter's thread included), Redis's CPU µs (both parts), the wall time
of each part, and the job hash's size in Redis (``MEMORY USAGE``, median of a sample).

    .venv/bin/python bench/tracing.py                  # 2,000 jobs, 7 rounds per mode
    .venv/bin/python bench/tracing.py --jobs 5000 --rounds 9

Results: bench/results/tracing.json and bench/results/tracing.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.runtime import tracing
from jobtier.worker.registry import TaskRegistry, task
from jobtier.worker.runner import Worker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, fresh, header_markdown, local_redis, redis_cpu, save, table

MODES = ("off", "on")
IN_FLIGHT = 50  # submits at once, as from concurrent requests
SAMPLE = 200  # job hashes whose MEMORY USAGE is taken


class Dropped(SpanExporter):
    """Takes the spans and drops them: the export's network cost is not jobtier's."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


@task(retries=0)
async def noop(ctx: Any, payload: Any) -> None:
    return None


REGISTRY = TaskRegistry([noop])


def request_context() -> SpanContext:
    """A sampled span context as an incoming traceparent names one (a fresh trace)."""
    ids = int.from_bytes(os.urandom(24), "big")
    return SpanContext(ids >> 64, ids & (2**64 - 1) or 1, True, TraceFlags(TraceFlags.SAMPLED))


async def submit_all(queue: Queue, n: int, traced: bool) -> list[str]:
    ids: list[str] = []
    todo = iter(range(n))

    async def client() -> None:
        for i in todo:
            if traced:
                with trace.use_span(NonRecordingSpan(request_context())):
                    job = await queue.submit(noop, {"n": i})
            else:
                job = await queue.submit(noop, {"n": i})
            ids.append(job.job_id)

    await asyncio.gather(*(client() for _ in range(IN_FLIGHT)))
    return ids


async def one_round(queue: Queue, mode: str, n: int, exporter: Dropped) -> dict[str, float]:
    provider = None
    if mode == "on":
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        tracing.install(provider)
    redis: Any = queue.redis  # a single server here (the helpers' type)
    try:
        await fresh(redis)
        exported = exporter.spans
        redis_before = await redis_cpu(redis)
        cpu, wall = time.process_time(), time.perf_counter()
        ids = await submit_all(queue, n, mode == "on")
        submit_cpu, submit_wall = time.process_time() - cpu, time.perf_counter() - wall
        sample = ids[:: max(1, n // SAMPLE)]
        sizes = [await queue.redis.memory_usage(queue.keys.job(i)) or 0 for i in sample]
        stored = sum([await queue.redis.hexists(queue.keys.job(i), "tp") for i in sample])
        worker = Worker(queue.store, REGISTRY, concurrency=50, burst=True, idle_poll=0.05)
        cpu, wall = time.process_time(), time.perf_counter()
        await worker.run()
        if provider is not None:
            provider.force_flush()  # the spans of this round exported within it
        work_cpu, work_wall = time.process_time() - cpu, time.perf_counter() - wall
        redis_used = await redis_cpu(redis) - redis_before
    finally:
        if provider is not None:
            tracing.install(None)
            provider.shutdown()
    assert worker.stats.succeeded == n, (worker.stats, n)
    assert stored == (len(sample) if mode == "on" else 0), stored
    spans = exporter.spans - exported
    assert spans == (n if mode == "on" else 0), spans
    return {
        "submit_cpu_us": submit_cpu / n * 1e6,
        "work_cpu_us": work_cpu / n * 1e6,
        "redis_cpu_us": redis_used / n * 1e6,
        "submit_wall_s": submit_wall,
        "work_wall_s": work_wall,
        "job_hash_bytes": statistics.median(sizes),
        "spans": spans,
    }


FIGURES = {
    "submit_cpu_us": "submit, CPU µs/job",
    "work_cpu_us": "worker, CPU µs/job",
    "redis_cpu_us": "Redis, CPU µs/job",
    "submit_wall_s": "submit, wall s",
    "work_wall_s": "worker, wall s",
    "job_hash_bytes": "job hash, bytes",
}


async def bench(url: str, n: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    settings = Settings(redis_url=url, shards=16)
    exporter = Dropped()
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    async with await Queue.connect(settings, REGISTRY) as queue:
        for mode in MODES:  # warm-up: imports, the scripts, the first connections
            await one_round(queue, mode, min(n, 500), exporter)
        for i in range(rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                results[mode].append(await one_round(queue, mode, n, exporter))
            print(f"round {i + 1}/{rounds}", file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per mode")
    args = parser.parse_args()
    env = environment()
    with local_redis() as server:
        try:
            import uvloop

            results = uvloop.run(bench(server.url, args.jobs, args.rounds))
        except ImportError:
            results = asyncio.run(bench(server.url, args.jobs, args.rounds))
    median = {m: {f: statistics.median(r[f] for r in results[m]) for f in FIGURES} for m in MODES}
    rows = []
    for figure, label in FIGURES.items():
        off, on = median["off"][figure], median["on"][figure]
        digits = 3 if figure.endswith("_s") else 1
        rows.append(
            [label, f"{off:,.{digits}f}", f"{on:,.{digits}f}", f"{on - off:+,.{digits}f}",
             f"{on / off:.2f}x" if off else "-"]
        )  # fmt: skip
    text = table(["per round (median)", "tracing off", "tracing on", "on - off", "on / off"], rows)
    print(text)
    markdown = (
        header_markdown("Tracing: the cost per job of OpenTelemetry spans, on against off", env)
        + f"\n{args.jobs:,} no-op jobs per round, submitted {IN_FLIGHT} at a time (each in a "
        "span context of its own when on), then drained by one Worker (concurrency 50); "
        f"{args.rounds} rounds per mode, the modes alternating, medians. On: an SDK "
        "TracerProvider, BatchSpanProcessor, an exporter that drops the spans.\n\n" + text
    )
    save(
        "tracing",
        {"environment": env, "args": vars(args), "median": median, "results": results},
        markdown,
    )


if __name__ == "__main__":
    main()
