"""Operations: Prometheus ``/metrics``, the live ``/dashboard`` and its data stream."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from importlib import resources
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jobtier.api.auth import require_admin
from jobtier.api.problems import UNAVAILABLE
from jobtier.api.sse import StreamResponse
from jobtier.metrics.gauges import live_gauges
from jobtier.metrics.histogram import quantile
from jobtier.metrics.prometheus import render
from jobtier.metrics.snapshot import HistogramWindow, parse_labels, read_snapshots, totals
from jobtier.queue import Queue


async def _lag_probe(request: Request) -> Any:
    ext = getattr(request.state, "pg_extension", None)
    return ext.current_lag if ext is not None else None


async def metrics(request: Request) -> Response:
    """Every live jobtier process's metrics, plus gauges read from Redis now."""
    if not request.state.settings.metrics_public:
        require_admin(request)
    queue: Queue = request.state.queue
    await request.state.metrics_publisher.publish()  # this process's own, fresh
    snapshots = await read_snapshots(queue.redis, queue.keys)
    gauges = await live_gauges(queue, await _lag_probe(request))
    return Response(render(snapshots, gauges), media_type=CONTENT_TYPE_LATEST)


async def dashboard_state(
    request: Request, window: HistogramWindow | None = None
) -> dict[str, Any]:
    """One frame of the dashboard: current gauges and cumulative counters (the page turns
    successive frames into rates); p99s over ``window`` (the last minute) when given, else
    since the processes started."""
    queue: Queue = request.state.queue
    snapshots = await read_snapshots(queue.redis, queue.keys)
    gauges = await live_gauges(queue, await _lag_probe(request))
    counters, hists = totals(snapshots)  # histograms since the processes started
    span = None
    if window is not None:
        hists, span = window.observe(time.time(), snapshots)
    p99 = {name: quantile(h, 0.99) for name, h in hists.items()}
    depth: dict[str, float] = defaultdict(float)  # per priority, over every queue
    queues: dict[str, dict[str, Any]] = defaultdict(lambda: {"queued": {}})
    for key, n in gauges["queue_depth"].items():
        lv = parse_labels(key)
        depth[lv["priority"]] += n
        queues[lv["queue"]]["queued"][lv["priority"]] = n
    for gauge, field in (("queue_running_jobs", "running"), ("queue_parked_jobs", "parked"),
                         ("queue_paused", "paused")):  # fmt: skip
        for key, n in gauges[gauge].items():
            queues[parse_labels(key)["queue"]][field] = n
    return {
        "at": time.time(),
        "queue_depth": dict(depth),
        "queues": dict(queues),
        "oldest_queued_age_seconds": max(gauges["oldest_queued_age_seconds"].values(), default=0.0),
        "scheduled": gauges["scheduled_jobs"][""],
        "running": gauges["running_jobs"][""],
        "dead_letters": gauges["dead_letter_jobs"][""],
        "workers": gauges["workers"][""],
        "lag_transitions": gauges.get("persister_lag_transitions", {}).get(""),
        "lag_seconds": gauges.get("persister_lag_seconds", {}).get(""),
        "counters": counters,
        "p99_claim_wait_seconds": p99.get("claim_wait_seconds"),
        "p99_run_time_seconds": p99.get("run_time_seconds"),
        "p99_window_seconds": span,  # None: since the processes started
        "processes": sorted({s.role for s in snapshots}),
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


class DashboardStream(StreamResponse):
    """A frame a second for as long as the page is open."""

    def __init__(self, request: Request, interval: float) -> None:
        super().__init__()
        self.request = request
        self.interval = interval

    async def _pump(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        frames: FrameCache = self.request.state.dashboard_frames
        while True:
            try:
                body = b"event: frame\ndata: %s\n\n" % await frames.get(self.request)
            except UNAVAILABLE as exc:
                # Redis or Postgres hiccup: say so and keep the stream (the page shows it)
                body = b": frame skipped: %s\n\n" % type(exc).__name__.encode()
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await asyncio.sleep(self.interval)


async def dashboard_stream(request: Request) -> Response:
    require_admin(request)
    return DashboardStream(request, 1.0)


# the page holds an admin key: it may talk to this server only, and be framed by nobody
PAGE_HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; img-src data:; connect-src 'self'; frame-ancestors 'none'",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}


async def dashboard(request: Request) -> Response:
    """The page itself: static, self-contained; it asks for the admin key and then reads
    the stream with it (the key never goes into a URL)."""
    page = (resources.files("jobtier.api") / "static" / "dashboard.html").read_bytes()
    return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


routes = [
    Route("/metrics", metrics, methods=["GET"]),
    Route("/dashboard", dashboard, methods=["GET"]),
    Route("/v1/admin/dashboard/stream", dashboard_stream, methods=["GET"]),
]
