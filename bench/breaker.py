"""Benchmark: 10,000 jobs against a downstream that is down for 30 s, with and without a
circuit breaker (docs/breakers.md).

Starts its own Redis (AOF on) and a downstream HTTP server of its own, in a subprocess
(``--serve``: it answers 200, or 503 while told it is down, and counts the calls). This
process runs one worker (concurrency 100) and one scheduler, submits the jobs, and turns the
downstream off at once: every job's first call meets the outage. After ``--down`` seconds
the downstream comes back; the cell ends when every job has finished (succeeded, or failed
for good).

Two cells, interleaved ``--runs`` times, the same task and retry policy (9 attempts, back-off
1 s doubling to 30 s, jitter 10 %):

* ``no breaker`` (the baseline): each job's attempts fail and back off on their own;
* ``breaker``: ``@task(breaker=Breaker("downstream", failures=20, window=10, open_for=2,
  max_open=8))``: the breaker opens on the first failures, holds the jobs without calling
  and without using attempts, and half-open probes find the downstream back.

Figures per cell (medians of the runs): calls the downstream got while down, attempts the
jobs used while it was down (a job held back by the breaker uses none), holds (jobs the
breaker turned away: a claim and a reschedule each, no call), jobs failed for good, and the
time from the downstream's return until every job had finished.

    .venv/bin/python bench/breaker.py                  # 10,000 jobs, 30 s outage, 3 runs
    .venv/bin/python bench/breaker.py --quick          # 2,000 jobs, 10 s outage, 1 run

Results: bench/results/breaker.json and bench/results/breaker.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TypedDict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    environment,
    fmt,
    fresh,
    header_markdown,
    local_redis,
    median,
    save,
    table,
)

from jobtier.worker.job_context import JobContext  # noqa: E402  (the task's annotation)


class Thresholds(TypedDict):
    """The breaker cell's ``Breaker`` arguments."""

    failures: int
    window: float
    open_for: float
    max_open: float


CONCURRENCY = 100
BREAKER: Thresholds = {"failures": 20, "window": 10.0, "open_for": 2.0, "max_open": 8.0}
RETRIES = 8
CELLS = ("no breaker", "breaker")
COLUMNS = {
    "downstream calls while down": "calls_while_down",
    "attempts used while down": "attempts_while_down",
    "holds (no call, no attempt)": "holds",
    "jobs failed for good": "failed",
    "drain after return, s": "drain_s",
    "cell, s": "total_s",
}


# --- the downstream (a subprocess) ----------------------------------------------------------
async def serve(port_file: Path) -> None:
    """A minimal HTTP/1.1 server (keep-alive): GET /call answers 200, or 503 while down;
    POST /down, /up switch it; GET /stats says what it counted. Its port goes to
    ``port_file``."""
    state = {"down": False, "calls": 0, "while_down": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target = head.split(b" ", 2)[:2]
                status, body = b"200 OK", b"ok"
                if target == b"/call":
                    state["calls"] += 1
                    if state["down"]:
                        state["while_down"] += 1
                        status, body = b"503 Service Unavailable", b"down"
                elif target in (b"/down", b"/up") and method == b"POST":
                    state["down"] = target == b"/down"
                elif target == b"/stats":
                    body = json.dumps(state).encode()
                elif target == b"/reset":
                    state.update(down=False, calls=0, while_down=0)
                writer.write(
                    b"HTTP/1.1 " + status + b"\r\ncontent-length: "
                    + str(len(body)).encode() + b"\r\n\r\n" + body
                )  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    port = str(server.sockets[0].getsockname()[1])
    await asyncio.to_thread(port_file.write_text, port)
    async with server:
        await server.serve_forever()


class Downstream:
    """The downstream subprocess, and a client to switch it and read its counts."""

    def __init__(self, folder: Path) -> None:
        port_file = folder / "downstream.port"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(port_file)], env=os.environ.copy()
        )
        deadline = time.monotonic() + 20
        while not port_file.exists() or not port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the downstream server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    async def control(self, http: Any, what: str) -> dict[str, Any]:
        if what == "stats":
            return dict((await http.get(f"{self.url}/stats")).json())
        await http.request("POST" if what in ("down", "up") else "GET", f"{self.url}/{what}")
        return {}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- one cell -------------------------------------------------------------------------------
async def cell(
    name: str, url: str, downstream: Downstream, args: argparse.Namespace
) -> dict[str, Any]:
    import httpx

    from jobtier.config import Settings
    from jobtier.core.breaker import Breaker, DownstreamDown
    from jobtier.core.model import JobSpec
    from jobtier.engine.queue import Queue
    from jobtier.scheduler import Scheduler
    from jobtier.worker.registry import TaskRegistry, task
    from jobtier.worker.runner import Worker

    settings = Settings.from_env({}, redis_url=url, shards=16)
    counts = {"succeeded": 0, "attempts_while_down": 0}
    down = {"now": False}
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    http = httpx.AsyncClient(limits=limits, timeout=10)
    target = f"{downstream.url}/call"

    async def call(ctx: JobContext, payload: Any) -> None:
        if down["now"]:
            counts["attempts_while_down"] += 1
        r = await http.get(target)
        if r.status_code >= 500:
            raise DownstreamDown(f"HTTP {r.status_code}")
        counts["succeeded"] += 1

    breaker = Breaker("downstream", **BREAKER) if name == "breaker" else None
    pay = task(
        name="pay", breaker=breaker, retries=RETRIES, backoff_base=1.0, backoff_cap=30.0, jitter=0.1
    )(call)
    queue = await Queue.connect(settings, catalog=False)
    await fresh(queue.redis)
    await downstream.control(http, "reset")
    for start in range(0, args.jobs, 1000):
        n = min(1000, args.jobs - start)
        await queue.submit_many([JobSpec(type="pay", payload=start + i) for i in range(n)])
    worker = Worker(queue.store, TaskRegistry([pay]), concurrency=CONCURRENCY, shutdown_grace=5)
    scheduler = Scheduler(queue.store)
    await downstream.control(http, "down")
    down["now"] = True
    started = time.monotonic()
    parts = [asyncio.create_task(worker.run()), asyncio.create_task(scheduler.run())]
    try:
        await asyncio.sleep(args.down)  # the outage: it lasts this long whatever we do
        await downstream.control(http, "up")
        down["now"] = False
        back = time.monotonic()
        seen = await downstream.control(http, "stats")
        while True:
            dead = (await queue.admin.stats())["total"].get("dead", 0)
            if counts["succeeded"] + dead >= args.jobs:
                break
            if time.monotonic() - back > args.timeout:
                raise RuntimeError(f"{name}: not drained after {args.timeout} s")
            await asyncio.sleep(0.05)
        done = time.monotonic()
    finally:
        worker.stop()
        scheduler.stop()
        for part in parts:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(part, 30)
        await http.aclose()
    holds = sum(worker.launcher.breakers.holds.values())
    await queue.close()
    return {
        "calls_while_down": seen["while_down"],
        "attempts_while_down": counts["attempts_while_down"],
        "holds": holds,
        "failed": dead,
        "drain_s": round(done - back, 2),
        "total_s": round(done - started, 2),
    }


# --- the table ------------------------------------------------------------------------------
def render(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, env: Any) -> str:
    md = header_markdown("Circuit breaker: a downstream down for a while", env)
    md += (
        f"\n{args.jobs:,} jobs submitted, then the downstream (an HTTP server of the bench's, in "
        f"a process of its own) answers 503 for {args.down:g} s, then 200. One worker at "
        f"concurrency {CONCURRENCY} and one scheduler in the bench's process, Redis AOF "
        f"everysec, 16 shards. Task: {RETRIES + 1} attempts, back-off 1 s doubling to 30 s "
        f"(jitter 10 %); with the breaker, `Breaker('downstream', failures=20, window=10, "
        f"open_for=2, max_open=8)`. Medians of {args.runs} interleaved run(s). The machine "
        "is shared and was loaded during the runs (load average above): absolute times move "
        "with it; the counts do not depend on speed as much.\n\n"
    )
    rows = []
    for name in CELLS:
        runs = results.get(name, [])
        rows.append(
            [name, *(fmt(median([float(r[k]) for r in runs]), 1 if k.endswith("_s") else 0)
                     for k in COLUMNS.values())]
        )  # fmt: skip
    md += table(["cell", *COLUMNS], rows) + "\n"
    base, with_b = results.get("no breaker"), results.get("breaker")
    if base and with_b:

        def ratio(key: str) -> str:
            b = median([float(r[key]) for r in base])
            w = median([float(r[key]) for r in with_b])
            return f"{b / w:,.0f}x" if w else "all of them"

        md += (
            f"\n- Calls to the downstream while it was down: {ratio('calls_while_down')} "
            "fewer with the breaker; attempts used meanwhile: "
            f"{ratio('attempts_while_down')} fewer.\n"
            "- Each run, per cell (calls while down / drain s): "
            + "; ".join(
                f"{n}: " + ", ".join(f"{r['calls_while_down']} / {r['drain_s']}" for r in rs)
                for n, rs in (("no breaker", base), ("breaker", with_b))
            )
            + ".\n"
        )
    return md


async def run_all(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    import tempfile

    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="jobtier-bench-breaker-") as folder:
        downstream = Downstream(Path(folder))
        try:
            with local_redis(aof=True) as server:
                for run in range(args.runs):
                    for name in CELLS:
                        figures = await cell(name, server.url, downstream, args)
                        results.setdefault(name, []).append(figures)
                        print(f"run {run + 1} {name}: {figures}", flush=True)
        finally:
            downstream.stop()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=10_000, help="jobs per cell (10000)")
    p.add_argument("--down", type=float, default=30.0, help="the outage, s (30)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs (3)")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on a drain, s (300)")
    p.add_argument("--quick", action="store_true", help="2,000 jobs, a 10 s outage, 1 run")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # the downstream subprocess
    args = p.parse_args(argv)
    if args.serve:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(Path(args.serve)))
        return
    if args.quick:
        args.jobs, args.down, args.runs = min(args.jobs, 2_000), min(args.down, 10.0), 1
    env = environment()
    results = asyncio.run(run_all(args))
    md = render(results, args, env)
    print(md)
    if not args.no_save:
        paths = save("breaker", {"args": vars(args), "env": env, "results": results}, md)
        print("saved", *paths)


if __name__ == "__main__":
    main()
