"""The /dashboard overview in headless Chromium, against a real stack: API, worker, scheduler
and persister (with Postgres), each publishing its metrics through Redis as in production.

The page is driven as a user would: type the admin key, click Connect, watch. The figures are
read from the DOM (stable ids, raw numbers in ``data-value``). The live test also takes the
README's pictures mid-run under a mixed load — the overview, the job list, a job with its
traceback, the dead letters; with ``JOBTIER_UPDATE_SCREENSHOT=1`` they replace those under
``docs/`` (otherwise they go to a temporary folder, so a test run leaves the checkout as it
was). test_dashboard_console.py drives the console's job, queue, worker and audit views.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.cdp import Page, chromium_page
from tests.e2e.dashboard_stack import (
    CHROMIUM,
    DOCS,
    IMAGES,
    NEEDS_CHROMIUM,
    Stack,
    go,
    log_in,
    stack_fixture,  # noqa: F401 - the `stack` fixture
    text,
    texts,
)
from tests.fixtures.api import ADMIN, KEYS, ApiServer
from tests.fixtures.engine import wait_for, worker_for

pytestmark = NEEDS_CHROMIUM
# the README's pictures: the overview, the job list, one job, the dead letters
PICTURES = ("dashboard", "console-jobs", "console-job", "console-dead-letters")

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


async def figures(page: Page) -> dict[str, Any]:
    values: dict[str, Any] = await page.evaluate(READ_FIGURES)
    return values


# --- a realistic load --------------------------------------------------------------------------
def demo_job(rng: random.Random) -> dict[str, Any]:
    """Mostly short sleeps, some instant echoes and CPU work, a few failures (retried, and
    some fatal: dead letters), in every priority, over three queues."""
    roll = rng.random()
    if roll < 0.58:
        job: dict[str, Any] = {
            "type": "sleep",
            "payload": {"seconds": round(rng.uniform(0.1, 0.8), 2)},
        }
    elif roll < 0.80:
        job = {"type": "echo", "payload": {"n": rng.randrange(1000)}, "queue": "emails"}
    elif roll < 0.91:
        job = {"type": "cpu", "payload": {"n": 20_000}, "queue": "reports"}
    elif roll < 0.96:
        job = {"type": "flaky", "payload": {"succeed_on": 2}}  # fails once, then succeeds
    else:
        job = {"type": "fail", "payload": {"fatal": rng.random() < 0.5}}  # dead letters
    job["priority"] = rng.choices(["critical", "high", "normal", "low"], [1, 3, 12, 4])[0]
    return job


Submitted = list[tuple[httpx.AsyncClient, str]]  # (the tenant's client, the job id)


async def submit_load(clients: list[httpx.AsyncClient], ids: Submitted, stop: asyncio.Event) -> int:
    """Submits batches four times a second (from each tenant in turn) until ``stop``, the
    rate following a slow wave with bursts, so the queue fills and drains while the page
    watches. Returns the jobs submitted."""
    rng = random.Random(6)
    start = time.monotonic()
    total = 0
    while not stop.is_set():
        elapsed = time.monotonic() - start
        wave = 7 + 6 * math.sin(2 * math.pi * elapsed / 14)
        burst = 25 if rng.random() < 0.04 else 0
        jobs = [demo_job(rng) for _ in range(max(1, round(wave + burst + rng.uniform(-2, 2))))]
        client = clients[total % len(clients)]
        r = await client.post("/v1/jobs/batch", json={"jobs": jobs})
        r.raise_for_status()
        ids.extend((client, item["job"]["id"]) for item in r.json()["results"])
        total += len(jobs)
        await asyncio.sleep(0.25)
    return total


async def poll_statuses(ids: Submitted) -> None:
    """A poller: status reads of recent jobs, often the same few (near-cache hits)."""
    rng = random.Random()
    while True:
        if ids:
            client, job_id = rng.choice(ids[-20:])
            await client.get(f"/v1/jobs/{job_id}")
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
        # nothing but the form: no view, no navigation
        assert await page.evaluate("document.body.dataset.view") == ""
        assert await page.evaluate(
            "[...document.querySelectorAll('.view, #nav')].every((e) => e.hidden)"
        )
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
        # the last data stays on screen, greyed
        assert await page.evaluate("!document.getElementById('view-overview').hidden")
        assert await page.evaluate(
            "document.getElementById('view-overview').classList.contains('stale')"
        )
        frames = await page.evaluate("Number(document.body.dataset.frames)")
        await page.wait_for("document.body.dataset.state === 'live'")  # the key was kept
        await page.wait_for(f"Number(document.body.dataset.frames) > {frames}")
        assert await page.evaluate("document.getElementById('banner').hidden")
        assert page.errors == []


async def test_the_page_is_one_document_and_runs_nothing_else(api: ApiServer) -> None:
    """No request leaves for anywhere but this server, and the policy allows the page's own
    script and style sheet only (by hash): an injected one would not run."""
    async with api.client(None) as c:
        r = await c.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    policy = r.headers["content-security-policy"]
    assert "script-src 'sha256-" in policy and "unsafe-inline" not in policy
    assert "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "http://" not in r.text and "https://" not in r.text  # no CDN, no external link
    assert r.text.count("<script>") == 1 and r.text.count("<style>") == 1
    assert CHROMIUM is not None
    async with chromium_page(CHROMIUM) as page:
        await page.goto(f"{api.url}/dashboard")
        await page.evaluate(
            "(() => { const s = document.createElement('script');"
            " s.textContent = 'window.injected = true'; document.body.append(s); })()"
        )
        assert await page.evaluate("window.injected === undefined")


async def test_the_page_follows_a_live_stack(stack: Stack, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    api = stack.api
    update = os.environ.get("JOBTIER_UPDATE_SCREENSHOT") == "1"
    folder = DOCS if update else tmp_path
    shots = {name: folder / f"{name}.png" for name in PICTURES}
    async with (
        chromium_page(CHROMIUM, width=1360, height=900, scale=2) as page,
        api.client() as acme,
        api.client("globex") as globex,
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
        assert await page.evaluate("!document.getElementById('view-overview').hidden")
        first = await figures(page)
        assert first["queue-depth"] == 0 and first["workers"] == 0
        assert first["lag-transitions"] is not None  # Postgres is configured

        # jobs wait while no worker runs: the page shows them queued, per priority
        waiting = [{"type": "echo", "priority": p} for p in ["high"] * 10 + ["normal"] * 30]
        r = await acme.post("/v1/jobs/batch", json={"jobs": waiting})
        assert r.status_code in (200, 201), r.text
        await page.wait_for("document.getElementById('queue-depth').dataset.value === '40'")
        now = await figures(page)
        assert (now["depth-high"], now["depth-normal"], now["depth-critical"]) == (10, 30, 0)
        # ... and per queue, in words and figures
        row = '#queue-summary tr[data-queue="default"]'
        await page.wait_for(
            f"document.querySelector('{row} [data-col=\"ready\"]')?.dataset.value === '40'"
        )
        cells = {
            c: await text(page, f"{row} [data-col='{c}']")
            for c in ("state", "ready", "critical", "high")
        }
        assert cells == {"state": "active", "ready": "40", "critical": "0", "high": "10"}, cells

        # one job of `images` failed for good, twice, run by a real worker: its log lines and
        # the traceback the worker recorded are the job page's picture
        await stack.advertise("resize", "images")
        image = (await acme.post("/v1/jobs", json={
            "type": "resize", "queue": "images", "max_attempts": 2,
            "payload": {"url": "s3://media/cat-4.png", "sizes": [64, 256, 1024]},
        })).json()  # fmt: skip

        async def image_failed() -> bool:
            # a burst worker ends when nothing is due: the retry is due once the scheduler
            # has moved it back (its backoff is 10 ms)
            await worker_for(stack.queue, IMAGES, burst=True, queues=["images"]).run()
            return await job_state(stack, image["id"], "failed")

        await wait_for(image_failed, timeout=30)

        sampler = Sampler(page)
        sampler.samples.append(now)  # the 40 waiting jobs, before any worker ran
        ids: Submitted = []
        stop_load = asyncio.Event()
        async with contextlib.AsyncExitStack() as tasks:
            running = [asyncio.create_task(sampler.run())]
            running += [asyncio.create_task(poll_statuses(ids)) for _ in range(3)]
            for task in running:
                tasks.callback(task.cancel)
            stack.start_worker(concurrency=8, queues=["default", "emails", "reports"])
            began = time.monotonic()
            load = asyncio.create_task(submit_load([acme, globex], ids, stop_load))
            tasks.callback(stop_load.set)

            # the load goes on until the page has shown all it moves, and a hundred jobs
            # (for the README's pictures: until the charts have some shape)
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
            # mid-run: the charts have shape, the lists have jobs in flight
            await page.screenshot(shots["dashboard"])
            await page.resize(1360, 900, scale=2)
            await go(page, "#/jobs", "jobs")
            assert len(await texts(page, "#jobs-grid tbody tr")) == 50  # a full first page
            await page.screenshot(shots["console-jobs"], full=False)  # its first rows
            await go(page, f"#/jobs/{image['id']}", "job")
            assert "LookupError: no image at s3://media/cat-4.png" in await text(page, "pre.trace")
            assert "fetching s3://media/cat-4.png" in await text(page, "#job-lines")
            await page.screenshot(shots["console-job"])
            await page.resize(1360, 900, scale=2)
            await go(page, "#/dead", "jobs")
            dead = await texts(page, "#jobs-grid tbody tr")
            assert dead and all("failed" in r for r in dead)
            await page.screenshot(shots["console-dead-letters"], full=False)
            await page.resize(1360, 900, scale=2)
            await page.evaluate("location.hash = '#/'")
            stop_load.set()
            submitted = await load

            # the load ends: the page sees the queue drain and the work done
            await page.wait_for(
                "document.getElementById('queue-depth').dataset.value === '0'"
                " && document.getElementById('running').dataset.value === '0'",
                timeout=60,
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
    for shot in shots.values():
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def job_state(stack: Stack, job_id: str, state: str) -> bool:
    return (await stack.queue.status(job_id)).state == state
