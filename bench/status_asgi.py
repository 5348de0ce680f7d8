"""Microbenchmark: CPU per ``GET /v1/jobs/{id}`` in the ASGI app itself, no HTTP server.

The app is called as granian calls it: an asyncio Task per request, with a fresh scope
(headers, the lifespan state copied), ``--concurrency`` requests started per event-loop
iteration. Cases, each the app's process CPU per request, medians of ``--runs``:

  hit    5 jobs read over and over (near-cache hits);
  miss   random jobs of ``--jobs`` with the near cache emptied first (coalesced Redis loads);
  floor  an ASGI app that only sends two messages: what the harness itself costs.

for the app as built (``fast``: ``app.JobtierApp`` answers ahead of Starlette) and with
``status_fast_path=False`` (``routed``: through Starlette's router), interleaved within
each run. Starts its own Redis in a temporary folder (uvloop, as the server runs).

    .venv/bin/python bench/status_asgi.py
    .venv/bin/python bench/status_asgi.py --concurrency 5 --no-save

Results: bench/results/status_asgi.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, header_markdown, local_redis, save, table
from common_http import KEY_OF, SHARDS, TENANTS, fill

from jobtier.api.app import create_app
from jobtier.config import Settings

Message = dict[str, Any]


async def floor_app(scope: Message, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"etag", b'"1"')]})
    await send({"type": "http.response.body", "body": b"{}"})


async def measure(args: argparse.Namespace, url: str, ids: list[tuple[str, str]]) -> list[Any]:
    settings = Settings.from_env(
        {},
        redis_url=url,
        shards=SHARDS,
        api_keys=",".join(f"{k}:{t}" for k, t in TENANTS.items()),
        admin_key="bench-admin-key",
    )
    apps = {"fast": create_app(settings), "routed": create_app(settings, status_fast_path=False)}
    states: dict[str, Message] = {}
    stops = []
    for name, app in apps.items():  # each app's lifespan: its own reader and near cache
        state: Message = {}
        events: asyncio.Queue[Message] = asyncio.Queue()
        started = asyncio.Event()
        await events.put({"type": "lifespan.startup"})

        async def lifespan_send(
            message: MutableMapping[str, Any], started: asyncio.Event = started
        ) -> None:
            if message["type"] == "lifespan.startup.complete":
                started.set()
            elif message["type"].endswith("failed"):
                raise RuntimeError(message)

        task = asyncio.create_task(
            app({"type": "lifespan", "state": state}, events.get, lifespan_send)
        )
        await started.wait()
        states[name] = state
        stops.append((events, task))

    loop = asyncio.get_running_loop()
    statuses: list[int] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    def scope(state: Message, job_id: str, tenant: str) -> Message:
        path = f"/v1/jobs/{job_id}"
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
            "scheme": "http", "method": "GET", "root_path": "", "path": path,
            "raw_path": path.encode(), "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1:8000"),
                (b"authorization", f"Bearer {KEY_OF[tenant]}".encode()),
                (b"accept", b"*/*"),
            ],
            "state": state.copy(),
        }  # fmt: skip

    async def run(app: Any, state: Message, reads: list[tuple[str, str]]) -> float:
        statuses.clear()
        c0 = time.process_time()
        for start in range(0, len(reads), args.concurrency):
            tasks = [
                loop.create_task(app(scope(state, job_id, tenant), receive, send))
                for job_id, tenant in reads[start : start + args.concurrency]
            ]
            await asyncio.gather(*tasks)
        cpu = (time.process_time() - c0) / len(reads) * 1e6
        assert statuses == [200] * len(reads), set(statuses)
        return cpu

    rng = random.Random(2)
    hot = rng.sample(ids, 5)
    cells: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.runs):
        for name, app in apps.items():
            state = states[name]
            reads = [hot[i % len(hot)] for i in range(args.requests)]
            await run(app, state, hot)  # the hot jobs in the near cache
            cells.setdefault(("hit", name), []).append(await run(app, state, reads))
            state["reader"].near.clear()
            reads = [ids[rng.randrange(len(ids))] for _ in range(args.requests)]
            cells.setdefault(("miss", name), []).append(await run(app, state, reads))
        reads = [hot[i % len(hot)] for i in range(args.requests)]
        cells.setdefault(("floor", "-"), []).append(await run(floor_app, {}, reads))
    for events, task in stops:
        await events.put({"type": "lifespan.shutdown"})
        await task
    return [
        {"case": case, "app": app, "cpu_us": statistics.median(v), "runs": v}
        for (case, app), v in cells.items()
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=20_000, help="jobs filled (20000)")
    p.add_argument("--requests", type=int, default=20_000, help="requests per cell (20000)")
    p.add_argument("--concurrency", type=int, default=20, help="requests per iteration (20)")
    p.add_argument("--runs", type=int, default=7, help="runs; figures are medians (7)")
    p.add_argument("--no-save", action="store_true", help="print only")
    args = p.parse_args()
    env = environment()
    with local_redis() as server:
        ids = asyncio.run(fill(server.url, args.jobs))
        rows = uvloop.run(measure(args, server.url, ids))
    markdown = "\n".join([
        header_markdown("Status reads in the ASGI app (no HTTP): CPU per request", env),
        f"- settings: {args.jobs:,} jobs, {args.requests:,} requests per cell, "
        f"{args.concurrency} started per event-loop iteration, a Task each; medians of "
        f"{args.runs} runs, the apps interleaved",
        "",
        table(
            ["case", "app", "cpu µs/req", "runs"],
            [
                [r["case"], r["app"], f"{r['cpu_us']:.2f}", " ".join(f"{x:.1f}" for x in r["runs"])]
                for r in rows
            ],
        ),
        "",
    ])  # fmt: skip
    print(markdown)
    if not args.no_save:
        for path in save("status_asgi", {**env, "settings": vars(args), "rows": rows}, markdown):
            print(f"saved {path}")


if __name__ == "__main__":
    main()
