"""The /dashboard page in headless Chromium, against a real stack: API, worker, scheduler and
persister (with Postgres), each publishing its metrics through Redis as in production.

The page is driven as a user would: type the admin key, click Connect, watch. The figures are
read from the DOM (stable ids, raw numbers in ``data-value``). The live test also takes a
screenshot mid-run under a mixed load; with ``JOBTIER_UPDATE_SCREENSHOT=1`` it replaces the
one the README shows, ``docs/dashboard.png`` (otherwise it goes to a temporary folder, so a
test run leaves the checkout as it was).

Chromium is Debian's ``chromium`` package (``$JOBTIER_CHROMIUM`` names another binary); it is
driven over the DevTools protocol by ``tests/e2e/cdp.py``. Without it these tests skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobtier.api.postgres import PostgresExtension
from jobtier.config import Settings
from jobtier.metrics.snapshot import MetricsPublisher, Source
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.queue import Queue
from jobtier.scheduler import Scheduler
from jobtier.worker.runner import Worker
from tests.e2e.cdp import Page, chromium_page, find_chromium
from tests.fixtures.api import ADMIN, KEYS, ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry

README_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
CHROMIUM = find_chromium()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium found (install Debian's `chromium` package, or set "
        "JOBTIER_CHROMIUM to a Chromium/Chrome binary)",
    ),
]

# every figure on the page, by element id
FIGURES = (
    "queue-depth", "depth-critical", "depth-high", "depth-normal", "depth-low", "oldest-age",
    "scheduled", "rate-submitted", "rate-completed", "rate-succeeded", "rate-claimed",
    "failure-ratio", "rate-failed", "rate-retried", "dead-letters", "dead-new", "workers",
    "running", "lag-seconds", "lag-transitions", "p99-claim-wait", "p99-run-time",
    "rate-status-reads", "rate-redis-loads", "near-cache-ratio",
)  # fmt: skip
READ_FIGURES = (
    "(() => { const out = {state: document.body.dataset.state,"
    " frames: Number(document.body.dataset.frames)};"
    f" for (const id of {json.dumps(FIGURES)}) {{"
    " const v = document.getElementById(id).dataset.value;"
    " out[id] = v === '' ? null : Number(v); }"
    " return out; })()"
)


async def log_in(page: Page, key: str) -> None:
    await page.type_into("#key-input", key)
    await page.click("#key-submit")


async def figures(page: Page) -> dict[str, Any]:
    values: dict[str, Any] = await page.evaluate(READ_FIGURES)
    return values


# --- the stack -------------------------------------------------------------------------------
@dataclass
class Stack:
    api: ApiServer
    queue: Queue
    background: Background
    publishers: list[MetricsPublisher] = field(default_factory=list)

    def publish(self, role: str, part: Source) -> None:
        publisher = MetricsPublisher(self.queue.redis, self.queue.keys, role, [part])
        publisher.start()
        self.publishers.append(publisher)

    def start_worker(self, concurrency: int) -> Worker:
        """A worker and the publisher of its metrics (claim wait, run time, outcomes)."""
        worker = worker_for(self.queue, registry, concurrency=concurrency, idle_poll=0.2)
        self.background.start(worker)
        self.publish("worker", worker)
        return worker


@pytest.fixture
async def stack(
    start_api: StartApi,
    pg_settings: Settings,
    queue: Queue,
    pg_pool: Pool,
    background: Background,
) -> AsyncIterator[Stack]:
    """API (with Postgres), scheduler and persister running, each publishing its metrics as
    in production; workers are the test's to start."""
    api = await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)
    stack = Stack(api, queue, background)
    # the job counters come from what the persister commits
    persister = Persister(pg_settings, queue.redis, pg_pool, "dashboard-persister")
    background.start(persister)
    background.start(Scheduler(queue))  # failed attempts come back through the scheduler
    stack.publish("persister", persister)
    try:
        yield stack
    finally:
        for publisher in stack.publishers:
            await publisher.stop()


# --- a realistic load --------------------------------------------------------------------------
def demo_job(rng: random.Random) -> dict[str, Any]:
    """Mostly short sleeps, some instant echoes and CPU work, a few failures (retried, and
    some fatal: dead letters), in every priority."""
    roll = rng.random()
    if roll < 0.58:
        job: dict[str, Any] = {
            "type": "sleep",
            "payload": {"seconds": round(rng.uniform(0.1, 0.8), 2)},
        }
    elif roll < 0.80:
        job = {"type": "echo", "payload": {"n": rng.randrange(1000)}}
    elif roll < 0.91:
        job = {"type": "cpu", "payload": {"n": 20_000}}
    elif roll < 0.96:
        job = {"type": "flaky", "payload": {"succeed_on": 2}}  # fails once, then succeeds
    else:
        job = {"type": "fail", "payload": {"fatal": rng.random() < 0.5}}  # dead letters
    job["priority"] = rng.choices(["critical", "high", "normal", "low"], [1, 3, 12, 4])[0]
    return job


async def submit_load(client: httpx.AsyncClient, ids: list[str], stop: asyncio.Event) -> int:
    """Submits batches four times a second until ``stop``, the rate following a slow wave with
    bursts, so the queue fills and drains while the page watches. Returns the jobs
    submitted."""
    rng = random.Random(6)
    start = time.monotonic()
    total = 0
    while not stop.is_set():
        elapsed = time.monotonic() - start
        wave = 7 + 6 * math.sin(2 * math.pi * elapsed / 14)
        burst = 25 if rng.random() < 0.04 else 0
        jobs = [demo_job(rng) for _ in range(max(1, round(wave + burst + rng.uniform(-2, 2))))]
        r = await client.post("/v1/jobs/batch", json={"jobs": jobs})
        r.raise_for_status()
        ids.extend(item["job"]["id"] for item in r.json()["results"])
        total += len(jobs)
        await asyncio.sleep(0.25)
    return total


async def poll_statuses(client: httpx.AsyncClient, ids: list[str]) -> None:
    """A poller: status reads of recent jobs, often the same few (near-cache hits)."""
    rng = random.Random()
    while True:
        if ids:
            await client.get(f"/v1/jobs/{rng.choice(ids[-20:])}")
        await asyncio.sleep(0.01)


class Sampler:
    """Reads the page's figures every few tenths of a second, for assertions on their course."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.samples: list[dict[str, Any]] = []

    async def run(self) -> None:
        while True:
            self.samples.append(await figures(self.page))
            await asyncio.sleep(0.3)

    def peak(self, name: str) -> float:
        """The highest value shown; -1 if the figure was never known."""
        return max((s[name] for s in self.samples if s[name] is not None), default=-1)

    def not_yet_shown(self) -> list[str]:
        """The figures the load must move that the page has not shown above zero yet."""
        return [name for name in MOVED_BY_LOAD if self.peak(name) <= 0]


# the figures a mixed load moves above zero (the failures: flaky and fatal jobs)
MOVED_BY_LOAD = (
    "rate-submitted", "rate-completed", "rate-claimed", "rate-succeeded", "running",
    "failure-ratio", "rate-failed", "dead-new", "rate-status-reads",
)  # fmt: skip
# the README's picture is taken this far into the load, when the charts have some shape
SCREENSHOT_AFTER = 22.0


# --- tests ---------------------------------------------------------------------------------
async def test_a_wrong_key_shows_an_error_not_a_blank_page(api: ApiServer) -> None:
    assert CHROMIUM is not None
    async with chromium_page(CHROMIUM) as page:
        await page.goto(f"{api.url}/dashboard")
        assert await page.evaluate("document.body.dataset.state") == "need-key"
        assert await page.evaluate("!document.getElementById('login').hidden")

        await log_in(page, "not-a-key")
        await page.wait_for("document.body.dataset.state === 'unauthorized'")
        error = await page.evaluate(
            "(() => { const e = document.getElementById('key-error');"
            " return e.hidden ? null : e.textContent; })()"
        )
        assert error is not None and "401" in error and "unknown API key" in error
        assert await page.evaluate("document.getElementById('conn-state').textContent") == (
            "Key refused"
        )
        assert await page.evaluate("document.getElementById('board').hidden")
        assert await page.evaluate("sessionStorage.length") == 0  # a refused key is not kept

        await log_in(page, KEYS["acme"])  # a tenant's key is not enough
        await page.wait_for("document.getElementById('key-error').textContent.includes('403')")
        assert await page.evaluate("document.body.dataset.state") == "unauthorized"
        assert await page.evaluate("location.href") == f"{api.url}/dashboard"
        assert page.errors == []


async def test_the_page_reconnects_when_the_stream_drops(api: ApiServer) -> None:
    assert CHROMIUM is not None
    async with chromium_page(CHROMIUM) as page:
        await page.goto(f"{api.url}/dashboard")
        await log_in(page, ADMIN)
        await page.wait_for("document.body.dataset.state === 'live'")
        lag = await page.evaluate("document.getElementById('lag-seconds').textContent")
        assert lag == "n/a"  # this server has no Postgres: nothing to lag behind
        # cut the connections under the server, as a restarting proxy would
        for connection in list(api.server.server_state.connections):
            connection.transport.abort()
        await page.wait_for("document.body.dataset.state === 'reconnecting'")
        banner = await page.evaluate(
            "(() => { const b = document.getElementById('banner');"
            " return b.hidden ? null : b.textContent; })()"
        )
        assert banner is not None and "Connection lost" in banner
        assert await page.evaluate("!document.getElementById('board').hidden")  # last data kept
        frames = await page.evaluate("Number(document.body.dataset.frames)")
        await page.wait_for("document.body.dataset.state === 'live'")  # the key was kept
        await page.wait_for(f"Number(document.body.dataset.frames) > {frames}")
        assert await page.evaluate("document.getElementById('banner').hidden")
        assert page.errors == []


async def test_the_page_follows_a_live_stack(stack: Stack, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    api = stack.api
    update = os.environ.get("JOBTIER_UPDATE_SCREENSHOT") == "1"
    screenshot = README_SCREENSHOT if update else tmp_path / "dashboard.png"
    async with (
        chromium_page(CHROMIUM, width=1360, height=900, scale=2) as page,
        api.client() as client,
    ):
        # still pictures: the "live" dot stops pulsing, so the screenshot never catches it faded
        await page.call(
            "Emulation.setEmulatedMedia",
            features=[{"name": "prefers-reduced-motion", "value": "reduce"}],
        )
        await page.goto(f"{api.url}/dashboard")
        await log_in(page, ADMIN)
        await page.wait_for("document.body.dataset.state === 'live'")
        # the key is kept for this tab, and in no URL
        assert await page.evaluate("sessionStorage.getItem('jobtier.dashboard.adminKey')") == ADMIN
        assert ADMIN not in await page.evaluate("location.href")
        assert await page.evaluate("!document.getElementById('board').hidden")
        first = await figures(page)
        assert first["queue-depth"] == 0 and first["workers"] == 0
        assert first["lag-transitions"] is not None  # Postgres is configured

        # jobs wait while no worker runs: the page shows them queued, per priority
        waiting = [{"type": "echo", "priority": p} for p in ["high"] * 10 + ["normal"] * 30]
        r = await client.post("/v1/jobs/batch", json={"jobs": waiting})
        assert r.status_code in (200, 201), r.text
        await page.wait_for("document.getElementById('queue-depth').dataset.value === '40'")
        now = await figures(page)
        assert (now["depth-high"], now["depth-normal"], now["depth-critical"]) == (10, 30, 0)
        # ... and per queue, in words and figures
        row = await page.evaluate(
            "[...document.querySelectorAll('#queue-rows tr[data-queue=\"default\"] > *')]"
            ".map((c) => c.textContent)"
        )
        assert row[:5] == ["default", "active", "40", "0", "10"], row

        sampler = Sampler(page)
        sampler.samples.append(now)  # the 40 waiting jobs, before any worker ran
        ids: list[str] = []
        stop_load = asyncio.Event()
        async with contextlib.AsyncExitStack() as tasks:
            running = [asyncio.create_task(sampler.run())]
            running += [asyncio.create_task(poll_statuses(client, ids)) for _ in range(3)]
            for task in running:
                tasks.callback(task.cancel)
            stack.start_worker(concurrency=8)
            began = time.monotonic()
            load = asyncio.create_task(submit_load(client, ids, stop_load))
            tasks.callback(stop_load.set)

            # the load goes on until the page has shown all it moves, and a hundred jobs
            # (for the README's picture: until the charts have some shape)
            def seen_enough() -> bool:
                if update and time.monotonic() - began < SCREENSHOT_AFTER:
                    return False
                return len(ids) > 100 and not sampler.not_yet_shown()

            try:
                await wait_for(seen_enough, timeout=240, interval=0.1)
            except TimeoutError:
                raise AssertionError(
                    f"after {len(ids)} jobs the page never showed {sampler.not_yet_shown()}"
                ) from None
            await page.screenshot(screenshot)  # mid-run: the charts have shape
            stop_load.set()
            submitted = await load

            # the load ends: the page sees the queue drain and the work done
            await page.wait_for(
                "document.getElementById('queue-depth').dataset.value === '0'"
                " && document.getElementById('running').dataset.value === '0'",
                timeout=30,
            )
        end = await figures(page)
        processes = await page.evaluate(
            "[...document.querySelectorAll('#processes .chip')].map(c => c.textContent)"
        )

    assert submitted == len(ids) > 100
    # live all along: frames came in through the load and the drain
    assert end["state"] == "live" and end["frames"] > now["frames"]
    assert sampler.peak("queue-depth") >= 40 and end["queue-depth"] == 0  # rose, then fell
    assert end["workers"] == 1
    assert end["dead-letters"] is not None and end["dead-letters"] > 0
    assert sampler.peak("near-cache-ratio") >= 0
    assert end["lag-transitions"] is not None and end["lag-seconds"] is not None
    assert end["p99-claim-wait"] is not None and end["p99-run-time"] is not None
    assert processes == ["api", "persister", "worker"]
    assert page.errors == [], page.errors
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
