"""Operations: Prometheus ``/metrics``, the live ``/dashboard`` and its data stream."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import time
from collections import defaultdict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.admission import refused_by_priority
from jobtier.api.auth import require_admin
from jobtier.api.gauges import live_gauges
from jobtier.api.problems import UNAVAILABLE
from jobtier.api.queues import queue_states
from jobtier.api.sse import StreamResponse
from jobtier.core.model import PRIORITIES
from jobtier.engine.queue import Queue
from jobtier.metrics.histogram import quantile
from jobtier.metrics.prometheus import render
from jobtier.metrics.snapshot import (
    HistogramWindow,
    Snapshot,
    parse_labels,
    read_snapshots,
    totals,
)


def _lag_probe(request: Request) -> Any:
    ext = getattr(request.state, "pg_extension", None)
    return ext.current_lag if ext is not None else None


def _outbox_probe(request: Request) -> Any:
    ext = getattr(request.state, "pg_extension", None)
    return ext.outbox_backlog if ext is not None else None


async def metrics(request: Request) -> Response:
    """Every live jobtier process's metrics, plus gauges read from Redis now."""
    if not request.state.settings.metrics_public:
        require_admin(request)
    queue: Queue = request.state.queue
    await request.state.metrics_publisher.publish()  # this process's own, fresh
    snapshots = await read_snapshots(queue.redis, queue.keys)
    gauges = await live_gauges(queue, _lag_probe(request), _outbox_probe(request))
    return Response(render(snapshots, gauges), media_type=CONTENT_TYPE_LATEST)


# the job counters the console turns into per-queue rates (metrics/transitions.py)
QUEUE_COUNTERS = (
    "jobs_submitted_total",
    "jobs_claimed_total",
    "jobs_succeeded_total",
    "jobs_failed_total",
    "jobs_dead_lettered_total",
    "jobs_cancelled_total",
)


def queue_counters(snapshots: list[Snapshot]) -> dict[str, dict[str, float]]:
    """{queue: {counter: total}} of the job counters, summed over processes and types."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for snap in snapshots:
        for name in QUEUE_COUNTERS:
            for key, value in snap.counters.get(name, {}).items():
                queue = parse_labels(key).get("queue")
                if queue is not None:  # None: counted by a persister from before the label
                    out[queue][name] += value
    return {q: dict(c) for q, c in out.items()}


async def dashboard_state(
    request: Request, window: HistogramWindow | None = None
) -> dict[str, Any]:
    """One frame of the dashboard: current gauges and cumulative counters (the page turns
    successive frames into rates); p99s over ``window`` (the last minute) when given, else
    since the processes started. ``queues`` is what ``GET /v1/admin/queues`` answers, each
    with its job counters. Each Redis read is made once for all the figures."""
    queue: Queue = request.state.queue
    snapshots = await read_snapshots(queue.redis, queue.keys)
    stats = await queue.admin.stats()
    ages = await queue.admin.oldest_queued()
    workers = await queue.admin.live_workers()
    lag = _lag_probe(request)
    lag_entries, lag_seconds = (await lag()) if lag is not None else (None, None)
    counters, hists = totals(snapshots)  # histograms since the processes started
    span = None
    if window is not None:
        hists, span = window.observe(time.time(), snapshots)
    p99 = {name: quantile(h, 0.99) for name, h in hists.items()}
    total = stats["total"]
    per_queue = queue_counters(snapshots)
    queues = await queue_states(
        queue, getattr(request.state, "catalog", None), stats=stats, ages=ages, workers=workers
    )
    for q in queues:
        q["counters"] = per_queue.get(q["name"], {})
    return {
        "at": time.time(),
        "queue_depth": {p.value: total.get(f"queued_{p.value}", 0) for p in PRIORITIES},
        "queues": queues,
        "oldest_queued_age_seconds": max(ages.values(), default=None),  # None: nothing waits
        "scheduled": total.get("scheduled", 0),
        "running": total.get("running", 0),
        "dead_letters": total.get("dead", 0),
        "workers": len(workers),
        "lag_transitions": lag_entries,
        "lag_seconds": lag_seconds,
        "counters": counters,
        "p99_claim_wait_seconds": p99.get("claim_wait_seconds"),
        "p99_run_time_seconds": p99.get("run_time_seconds"),
        "p99_window_seconds": span,  # None: since the processes started
        "processes": sorted({s.role for s in snapshots}),
        # jobs refused per reason and priority ("shed": load shedding), since the APIs started
        "submits_refused": refused_by_priority(snapshots),
        "postgres": hasattr(request.state, "pg_reader"),  # the console's job pages need it
    }


class FrameCache:
    """One dashboard frame a second per API process, however many pages are open."""

    def __init__(self, max_age: float = 0.9) -> None:
        self.max_age = max_age
        self.window = HistogramWindow(60.0)
        self.frame = b""
        self.made = 0.0
        self._lock = asyncio.Lock()

    async def get(self, request: Request) -> bytes:
        async with self._lock:
            if time.monotonic() - self.made > self.max_age:
                self.frame = orjson.dumps(await dashboard_state(request, self.window))
                self.made = time.monotonic()
            return self.frame


async def _frames(request: Request) -> AsyncGenerator[bytes, None]:
    """A frame a second for as long as the page is open."""
    frames: FrameCache = request.state.dashboard_frames
    while True:
        try:
            body = b"event: frame\ndata: %s\n\n" % await frames.get(request)
        except UNAVAILABLE as exc:
            # Redis or Postgres hiccup: say so and keep the stream (the page shows it)
            body = b": frame skipped: %s\n\n" % type(exc).__name__.encode()
        yield body
        await asyncio.sleep(1.0)


async def dashboard_stream(request: Request) -> Response:
    require_admin(request)
    return StreamResponse(_frames(request))


# The page's scripts in static/, run in this order in one scope (each defines what the later
# ones use).
SCRIPTS = [
    "core",
    "stream",
    "charts",
    "overview",
    "shedding",
    "queues",
    "breakers",
    "jobs",
    "job",
    "workers",
    "audit",
    "app",
]


@dataclass(frozen=True, slots=True)
class Page:
    body: bytes
    headers: dict[str, str]


@functools.cache
def console_page() -> Page:
    """The console: one self-contained document put together from its parts once per
    process (no build step; nothing fetched from elsewhere). The style sheet and the script
    are inline, and the Content-Security-Policy allows exactly them, by hash: the page holds
    an admin key, so nothing else may run in it, it may talk to this server only, and
    nobody may frame it."""
    static = resources.files("jobtier.api") / "static"
    style = (static / "dashboard.css").read_text(encoding="utf-8")
    script = "\n".join(
        f"// --- {name}.js\n" + (static / f"{name}.js").read_text(encoding="utf-8")
        for name in SCRIPTS
    )
    script = f'(() => {{\n"use strict";\n{script}\n}})();\n'
    markup = (static / "dashboard.html").read_text(encoding="utf-8")
    markup = markup.replace("<!--style-->", f"<style>{style}</style>")
    page = markup.replace("<!--script-->", f"<script>{script}</script>")

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    policy = (
        f"default-src 'none'; script-src {digest(script)}; style-src {digest(style)}; "
        "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    headers = {
        "cache-control": "no-cache",
        "content-security-policy": policy,
        "referrer-policy": "no-referrer",
        "x-content-type-options": "nosniff",
    }
    return Page(page.encode(), headers)


async def dashboard(request: Request) -> Response:
    """The page itself: static, self-contained; it asks for the admin key and then calls
    the admin routes with it (the key never goes into a URL)."""
    page = console_page()
    return Response(page.body, media_type="text/html; charset=utf-8", headers=page.headers)
