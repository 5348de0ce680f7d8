"""What the browser tests of /dashboard share: a real stack (API with Postgres, persister,
scheduler, workers when a test starts them, each publishing its metrics through Redis as in
production), the headless page logged in, and helpers that read the page as a person sees it.

Chromium is Debian's ``chromium`` package (``$JOBTIER_CHROMIUM`` names another binary); it is
driven over the DevTools protocol by ``tests/e2e/cdp.py``. Without it the tests skip.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.engine.catalog import publish
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import MetricsPublisher, Source
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.persist.retention import ensure_partitions
from jobtier.scheduler import Scheduler
from jobtier.store.calls import fail_call
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from jobtier.worker.runner import Worker
from tests.e2e.cdp import Page, find_chromium
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import Background, worker_for
from tests.tasks import registry

DOCS = Path(__file__).resolve().parents[2] / "docs"
CHROMIUM = find_chromium()
NEEDS_CHROMIUM = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium found (install Debian's `chromium` package, or set "
        "JOBTIER_CHROMIUM to a Chromium/Chrome binary)",
    ),
]
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/srv/app/tasks.py", line 41, in resize\n'
    '    image = await fetch_image(payload["url"])\n'
    '  File "/srv/app/images.py", line 17, in fetch_image\n'
    '    raise LookupError(f"no image at {url}")\n'
    "LookupError: no image at s3://media/cat-4.png\n"
)


@task(queue="images", retries=1, backoff_base=0.01, jitter=0)
async def resize(ctx: JobContext, payload: Any) -> None:
    """The pictures' failing job: logs what it does, then fails as a real task does (the
    worker records its traceback); its one retry fails the same way."""
    url = payload["url"]
    ctx.log(f"fetching {url}")
    ctx.log(f"resizing to {', '.join(map(str, payload['sizes']))} px")
    raise LookupError(f"no image at {url}")


IMAGES = TaskRegistry([resize])


@dataclass
class Stack:
    api: ApiServer
    queue: Queue
    background: Background
    persister: Persister
    publishers: list[MetricsPublisher] = field(default_factory=list)

    def publish(self, role: str, part: Source) -> None:
        publisher = MetricsPublisher(self.queue.redis, self.queue.keys, role, [part])
        publisher.start()
        self.publishers.append(publisher)

    def start_worker(
        self,
        concurrency: int,
        *,
        tasks: TaskRegistry = registry,
        queue: Queue | None = None,
        **kwargs: Any,
    ) -> Worker:
        """A worker (of ``tasks``, on ``queue``'s connection and settings: the stack's by
        default) and the publisher of its metrics (claim wait, run time, outcomes)."""
        q = queue or self.queue
        worker = worker_for(q, tasks, concurrency=concurrency, idle_poll=0.2, **kwargs)
        self.background.start(worker)
        self.publish("worker", worker)
        return worker

    async def fail_with_traceback(
        self, job_id: str, queue: str, worker: str = "w-images-1", retry_ms: int = -1
    ) -> None:
        """One attempt of a waiting job run as a worker runs it, failing with an error that
        carries a traceback (as workers that record one send it): for good, or retried after
        ``retry_ms``."""
        q = self.queue
        shard = q.keys.shard_of(job_id)
        batch = await q.scripts.claim(shard, worker, 1, 30_000, queues=[(queue, -1)])
        assert [j.id for j in batch.jobs] == [job_id]
        error = json.dumps({"type": "LookupError", "message": "no image at s3://media/cat-4.png",
                            "traceback": TRACEBACK})  # fmt: skip
        lease = batch.jobs[0].lease_version
        call = fail_call(shard, worker, 3600, [(job_id, lease, error, retry_ms)])
        expected = b"failed" if retry_ms < 0 else b"scheduled"
        assert await q.scripts.call(*call) == [0, expected]

    async def advertise(self, name: str, queue: str) -> None:
        """A task a worker elsewhere runs (in the catalogue: the API accepts its jobs)."""

        async def run(ctx: Any, payload: Any) -> None: ...

        run.__name__ = name
        await publish(self.queue.redis, self.queue.keys, [task(queue=queue)(run).ad("w-images-1")])


@pytest.fixture(name="stack")
async def stack_fixture(
    start_api: StartApi,
    pg_settings: Settings,
    queue: Queue,
    pg_pool: Pool,
    background: Background,
) -> AsyncIterator[Stack]:
    """API (with Postgres), scheduler and persister running, each publishing its metrics as
    in production; workers are the test's to start."""
    api = await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)
    # The history's daily partitions exist before the persister writes: its first pruning
    # pass would otherwise attach them while it inserts, and Postgres then refuses a row
    # routed to the default partition just before (the persister parks it as bad data).
    async with pg_pool.acquire() as conn:
        await ensure_partitions(conn, datetime.now(UTC))
    # the job counters come from what the persister commits
    persister = Persister(pg_settings, queue.redis, pg_pool, "dashboard-persister")
    stack = Stack(api, queue, background, persister)
    background.start(persister)
    background.start(Scheduler(queue.store))  # failed attempts come back through the scheduler
    stack.publish("persister", persister)
    try:
        yield stack
    finally:
        for publisher in stack.publishers:
            await publisher.stop()


# --- reading and driving the page -------------------------------------------------------------
async def log_in(page: Page, key: str) -> None:
    await page.type_into("#key-input", key)
    await page.click("#key-submit")


async def open_console(page: Page, url: str, key: str, fragment: str = "") -> None:
    """Go to the page, give the key, wait until it is live (and on ``fragment``'s view)."""
    await page.goto(f"{url}/dashboard{fragment}")
    await log_in(page, key)
    await page.wait_for("document.body.dataset.state === 'live' && document.body.dataset.view")


async def go(page: Page, fragment: str, view: str) -> int:
    """Follow a link to ``fragment`` (as clicking one would) and wait until ``view`` has drawn;
    returns the count of its draws so far."""
    before = await drawn(page, view)
    await page.evaluate(f"location.hash = {json.dumps(fragment)}")
    return await redrawn(page, view, before)


async def drawn(page: Page, view: str) -> int:
    value = await page.evaluate(
        f"Number(document.getElementById('view-{view}').dataset.loaded || 0)"
    )
    return int(value)


async def redrawn(page: Page, view: str, before: int, timeout: float = 15.0) -> int:
    """Wait until ``view`` has drawn again after ``before`` draws."""
    await page.wait_for(
        f"!document.getElementById('view-{view}').hidden && "
        f"Number(document.getElementById('view-{view}').dataset.loaded || 0) > {before}",
        timeout=timeout,
    )
    return await drawn(page, view)


async def texts(page: Page, selector: str) -> list[str]:
    """The visible texts of the elements ``selector`` matches, whitespace collapsed."""
    value: list[str] = await page.evaluate(
        f"[...document.querySelectorAll({json.dumps(selector)})]"
        ".filter((e) => e.offsetParent !== null || e.tagName === 'TR')"
        ".map((e) => e.innerText.replace(/\\s+/g, ' ').trim())"
    )
    return value


async def text(page: Page, selector: str) -> str:
    value: str = await page.evaluate(
        f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
        " return e ? e.innerText.replace(/\\s+/g, ' ').trim() : null; })()"
    )
    return value


async def set_field(page: Page, selector: str, value: str) -> None:
    """Choose a value in a select or date field as a person does (the input and change
    events fire); text fields are typed into (``type_into``)."""
    await page.evaluate(
        f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
        f" e.focus(); e.value = {json.dumps(value)};"
        " e.dispatchEvent(new Event('input', {bubbles: true}));"
        " e.dispatchEvent(new Event('change', {bubbles: true})); })()"
    )


async def clear_and_type(page: Page, selector: str, value: str) -> None:
    await page.evaluate(f"document.querySelector({json.dumps(selector)}).value = ''")
    if value:
        await page.type_into(selector, value)


async def confirm(page: Page, typed: str | None = None) -> str:
    """Answer the confirmation dialog: its title; types ``typed`` first when asked to."""
    await page.wait_for("document.getElementById('confirm').open")
    title = await text(page, "#confirm-title")
    if typed is not None:
        assert await page.evaluate("document.getElementById('confirm-ok').disabled")
        await page.type_into("#confirm-input", typed)
        await page.wait_for("!document.getElementById('confirm-ok').disabled")
    await page.evaluate("document.getElementById('toast').hidden = true")  # the next is ours
    await page.click("#confirm-ok")
    await page.wait_for("!document.getElementById('confirm').open")
    return title


async def toast(page: Page) -> str:
    """The message the page announced after an action."""
    await page.wait_for("!document.getElementById('toast').hidden")
    return await text(page, "#toast")
