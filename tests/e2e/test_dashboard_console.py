"""The console in headless Chromium, driven as an operator would against a real stack: find
a job by filters, open it, read its traceback, replay it; pause a queue, unblock one and purge
one; watch rows and workers change live; read the audit. Every assertion is on what the page shows."""

from __future__ import annotations

import pytest

from jobtier.api.audit import fingerprint
from jobtier.config import Settings
from jobtier.engine.queue import Queue
from tests import debug_tasks
from tests.e2e.cdp import chromium_page
from tests.e2e.dashboard_stack import (
    CHROMIUM,
    NEEDS_CHROMIUM,
    Stack,
    confirm,
    drawn,
    go,
    open_console,
    redrawn,
    set_field,
    stack_fixture,  # noqa: F401 - the `stack` fixture
    text,
    texts,
    toast,
)
from tests.fixtures.api import ADMIN
from tests.fixtures.engine import wait_for, worker_for
from tests.tasks import registry

pytestmark = NEEDS_CHROMIUM


async def test_find_a_failed_job_read_its_traceback_and_replay_it(stack: Stack) -> None:
    assert CHROMIUM is not None
    api = stack.api
    async with api.client() as acme, api.client("globex") as globex:
        for i in range(5):
            await acme.post("/v1/jobs", json={"type": "echo", "payload": {"n": i}})
            await globex.post("/v1/jobs", json={"type": "echo", "payload": {"n": i}})
        broken = (
            await acme.post("/v1/jobs", json={"type": "echo", "queue": "images",
                                              "payload": {"url": "s3://media/cat-4.png"}})
        ).json()  # fmt: skip
        other = (await globex.post("/v1/jobs", json={"type": "echo", "queue": "images"})).json()
    await stack.fail_with_traceback(broken["id"], "images")
    await stack.fail_with_traceback(other["id"], "images", worker="w-images-2")
    worker = stack.start_worker(concurrency=4)
    await stack.persister.drain()

    async def done() -> bool:
        queued: int = (await stack.queue.admin.stats())["total"]["queued"]
        return queued == 0

    await wait_for(done)
    await stack.persister.drain()

    async with chromium_page(CHROMIUM) as page:
        await open_console(page, api.url, ADMIN)
        # the operator opens the job list, and narrows it: failed jobs of tenant acme
        before = await drawn(page, "jobs")
        await page.click('#nav a[data-view="jobs"]')
        before = await redrawn(page, "jobs", before)  # every job, newest first
        assert len(await texts(page, "#jobs-grid tbody tr")) == 12
        await set_field(page, "#f-state", "failed")
        await page.type_into("#f-tenant", "acme")
        await page.click("#f-apply")
        await redrawn(page, "jobs", before)
        assert "state=failed" in await page.evaluate("location.hash")
        rows = await texts(page, "#jobs-grid tbody tr")
        assert len(rows) == 1, rows
        assert broken["id"] in rows[0] and "failed" in rows[0] and "acme" in rows[0]
        assert await text(page, "#jobs-grid tbody tr [data-col='state']") == "failed"

        # opens it: its traceback, its attempt, its history, its payload
        before = await drawn(page, "job")
        await page.click(f'#jobs-grid a[href="#/jobs/{broken["id"]}"]')
        await redrawn(page, "job", before)
        assert await text(page, "#job-title") == f"Job {broken['id']}"
        assert await text(page, '[data-section="head"] .state') == "failed"
        trace = await page.evaluate(
            "[...document.querySelectorAll('pre.trace')].map((e) => e.textContent)"
        )
        assert trace and all("LookupError: no image at s3://media/cat-4.png" in t for t in trace)
        assert 'File "/srv/app/images.py", line 17, in fetch_image' in trace[0]
        attempts = await texts(page, "details.attempt summary")
        assert len(attempts) == 1 and "Attempt 1" in attempts[0] and "w-images-1" in attempts[0]
        assert await page.evaluate("document.querySelector('details.attempt').open")
        history = await texts(page, "#history-grid tbody tr")
        assert len(history) == 3, history
        assert "created queued" in history[0] and "queued → running" in history[1]
        assert "running → failed" in history[2] and "LookupError" in history[2]
        data = await text(page, '[data-section="data"]')
        assert "s3://media/cat-4.png" in data and "No result: the job failed" in data

        # replays it, after saying yes: the page shows it queued again, live
        await page.click('[data-section="head"] button[data-act="replay"]')
        title = await confirm(page)
        assert title == f"Replay job {broken['id']}?"
        assert f"Job {broken['id']} replayed" in await toast(page)
        await page.wait_for(
            "document.querySelector('[data-section=\"head\"] .state').textContent !== 'failed'"
        )
        # a worker of `images` runs it now: the page follows it to its end
        images = stack.start_worker(concurrency=1, queues=["images"])
        await page.wait_for(
            "document.querySelector('[data-section=\"head\"] .state').textContent === 'succeeded'",
            timeout=30,
        )
        images.stop()

        # the audit says who did it
        await go(page, "#/audit", "audit")
        rows = await texts(page, ".audit-grid tbody tr")
        assert len(rows) == 1 and "job.replay" in rows[0] and broken["id"] in rows[0]
        assert f"{fingerprint(ADMIN)} (you)" in rows[0] and "200 done" in rows[0]
        assert page.errors == [], page.errors
    worker.stop()


async def test_a_job_page_shows_its_log_lines_and_links_a_stored_result(
    stack: Stack, pg_settings: Settings
) -> None:
    """Run by real workers: a task that logs and fails its first attempt (the worker records
    the traceback), and one whose result is large enough for the result store."""
    assert CHROMIUM is not None
    store = pg_settings.replace(result_store="postgres", result_store_threshold_bytes=1000)
    stored_queue = await Queue.connect(store, catalog=False)
    try:
        big = await stored_queue.submit("big_result", 3000, tenant="acme")
        await worker_for(stored_queue, registry, burst=True).run()
        chatty = await stack.queue.submit("chatty", {"n": 2, "fail_first": True}, tenant="acme")
        stack.start_worker(concurrency=1, tasks=debug_tasks.registry)

        async def ran() -> bool:
            return (await stack.queue.status(chatty.job_id)).state == "succeeded"

        await wait_for(ran, timeout=30)
        await stack.persister.drain()
        async with chromium_page(CHROMIUM) as page:
            await open_console(page, stack.api.url, ADMIN, f"#/jobs/{chatty.job_id}")
            await page.wait_for("document.getElementById('view-job').dataset.loaded")
            await page.wait_for("document.getElementById('job-lines') !== null")
            lines = await texts(page, "#job-lines li")
            assert len(lines) == 6, lines
            assert lines[0].endswith("attempt 1 line 0") and lines[-1].endswith("attempt 2 done")
            assert "6" in await text(page, "#h-lines")
            # the first attempt's error as the worker recorded it: a real traceback
            trace = await page.evaluate(
                "[...document.querySelectorAll('details.attempt pre.trace')]"
                ".map((e) => e.textContent)"
            )
            assert len(trace) == 1 and trace[0].startswith("Traceback (most recent call last)")
            assert trace[0].rstrip().endswith("RuntimeError: first attempt fails")
            # the success keeps the earlier error in its document: shown as that, not its own
            history = await texts(page, "#history-grid tbody tr")
            assert [row for row in history if "RuntimeError" in row] == [
                row for row in history if "running → scheduled" in row
            ]
            now = await text(page, '[data-section="now"]')
            assert "error of an earlier attempt" in now.lower()  # (headings are upper case)

            await go(page, f"#/jobs/{big.job_id}", "job")
            shown = await text(page, "#result-stored")
            assert "Kept in the result store" in shown and f"pg:{big.job_id}:" in shown
            assert f"/v1/jobs/{big.job_id}/result/content" in shown
            assert await page.evaluate(  # named, not inlined
                "document.getElementById('result-stored').closest('section')"
                ".querySelector('pre.json') === null"
            )
            empty = await text(page, "#view-job [aria-labelledby='h-lines'] p")
            assert "logged nothing" in empty
            assert page.errors == [], page.errors
    finally:
        await stored_queue.close()


async def test_pause_a_queue_and_purge_its_backlog(stack: Stack) -> None:
    assert CHROMIUM is not None
    api = stack.api
    async with api.client() as acme:
        jobs = [
            {"type": "echo", "queue": "bulk", "priority": p} for p in ["high"] * 10 + ["low"] * 20
        ]
        assert (await acme.post("/v1/jobs/batch", json={"jobs": jobs})).status_code == 200
        kept = (await acme.post("/v1/jobs", json={"type": "echo", "queue": "emails"})).json()

    async with chromium_page(CHROMIUM) as page:
        await open_console(page, api.url, ADMIN, "#/queues")
        await page.wait_for("document.body.dataset.view === 'queues'")
        row = 'tr[data-queue="bulk"]'
        await page.wait_for(
            f"document.querySelector('{row} [data-col=\"ready\"]')?.dataset.value === '30'"
        )
        assert await text(page, f"{row} [data-col='high']") == "10"
        assert await text(page, f"{row} [data-col='low']") == "20"
        assert await text(page, f"{row} [data-col='state']") == "active"

        await page.click(f'{row} button[data-act="toggle"]')
        assert await confirm(page) == "Pause queue bulk?"
        assert "paused" in await toast(page)
        await page.wait_for(
            f"document.querySelector('{row} [data-col=\"state\"]').textContent === 'paused'"
        )
        assert await text(page, f'{row} button[data-act="toggle"]') == "Resume"

        # purging asks for the queue's name before it lets the button go
        await page.click(f'{row} button[data-act="purge"]')
        await page.wait_for("document.getElementById('confirm').open")
        assert "30 jobs waiting in bulk" in await text(page, "#confirm-text")
        assert await confirm(page, typed="bulk") == "Purge the ready jobs of bulk?"
        assert "Queue bulk purged: 30 jobs cancelled." in await toast(page)
        await page.wait_for(
            f"document.querySelector('{row} [data-col=\"ready\"]').dataset.value === '0'"
        )
        assert await page.evaluate(
            f"document.querySelector('{row} button[data-act=\"purge\"]').disabled"
        )
        emails = await text(page, 'tr[data-queue="emails"] [data-col="ready"]')
        assert emails == "1"

        # Postgres has them cancelled: the job list, by queue and state, says so
        await stack.persister.drain()
        view = await go(page, "#/jobs?queue=bulk&state=cancelled", "jobs")
        assert view > 0
        rows = await texts(page, "#jobs-grid tbody tr")
        assert len(rows) == 30 and all("cancelled" in r for r in rows)

        # and the audit, newest first: the purge (with its count), then the pause
        await go(page, "#/audit", "audit")
        rows = await texts(page, ".audit-grid tbody tr")
        assert ["queue.purge" in rows[0], "queue.pause" in rows[1]] == [True, True], rows
        assert '"cancelled":30' in rows[0]
        assert page.errors == [], page.errors
    assert (await stack.queue.status(kept["id"])).state == "queued"


async def test_unblock_a_queue_a_partner_held_back(stack: Stack) -> None:
    assert CHROMIUM is not None
    api = stack.api
    async with api.client() as acme:
        for queue in ("partner", "emails"):
            r = await acme.post("/v1/jobs", json={"type": "echo", "queue": queue})
            assert r.status_code == 202, r.text
    await stack.queue.admin.block("partner", 600)  # as a task's RateLimited(retry_after=600)

    async with chromium_page(CHROMIUM) as page:
        await open_console(page, api.url, ADMIN, "#/queues")
        row = 'tr[data-queue="partner"]'
        unblock = f'{row} button[data-act="unblock"]'
        await page.wait_for(
            f"document.querySelector('{row} [data-col=\"state\"]')?.textContent"
            ".startsWith('held until')"
        )
        assert not await page.evaluate(f"document.querySelector('{unblock}').hidden")
        # a queue that is not blocked offers no unblock
        assert await page.evaluate(
            'document.querySelector(\'tr[data-queue="emails"] button[data-act="unblock"]\').hidden'
        )

        await page.click(unblock)
        assert await confirm(page) == "Unblock queue partner?"
        assert "Queue partner unblocked: its hold until" in await toast(page)
        await page.wait_for(
            f"document.querySelector('{row} [data-col=\"state\"]').textContent === 'active'"
        )
        assert await page.evaluate(f"document.querySelector('{unblock}').hidden")
        stats = await stack.queue.admin.stats()
        assert stats["queues"]["partner"]["blocked_until_ms"] == 0

        await go(page, "#/audit", "audit")
        rows = await texts(page, ".audit-grid tbody tr")
        assert "queue.unblock" in rows[0], rows
        assert page.errors == [], page.errors


async def test_in_flight_rows_and_workers_change_live(stack: Stack) -> None:
    assert CHROMIUM is not None
    api = stack.api
    async with api.client() as acme:
        slow = (
            await acme.post("/v1/jobs", json={"type": "sleep", "payload": {"seconds": 60}})
        ).json()
    await stack.persister.drain()

    async with chromium_page(CHROMIUM) as page:
        await open_console(page, api.url, ADMIN, "#/jobs")
        row = f'#jobs-grid tr[data-id="{slow["id"]}"]'
        await page.wait_for(f"document.querySelector('{row}')?.dataset.state === 'queued'")
        # a worker takes it: the row turns running without a reload
        stack.start_worker(concurrency=2)
        await page.wait_for(
            f"document.querySelector('{row}').dataset.state === 'running'", timeout=20
        )
        assert await text(page, f"{row} [data-col='attempt']") == f"1 / {slow['max_attempts']}"

        # the workers view shows the worker and the job it runs
        await go(page, "#/workers", "workers")
        await page.wait_for(
            "document.querySelector('#workers-grid tbody tr')?.innerText.includes('sleep')"
        )
        worker_row = (await texts(page, "#workers-grid tbody tr"))[0]
        assert slow["id"] in worker_row and "1 / 2" in worker_row and "default" in worker_row
        assert "ago" in worker_row or "just now" in worker_row

        # cancelled from the job list: the row says so at once
        await go(page, "#/jobs", "jobs")
        await page.click(f'{row} button[data-act="cancel"]')
        assert await confirm(page) == f"Cancel job {slow['id']}?"
        assert "asked to stop" in await toast(page)
        await page.wait_for(
            f"document.querySelector('{row}').dataset.state === 'cancelled'", timeout=20
        )
        assert page.errors == [], page.errors


async def test_run_a_delayed_job_now(stack: Stack) -> None:
    assert CHROMIUM is not None
    api = stack.api
    async with api.client() as acme:
        later = {"type": "echo", "payload": {"n": 1}, "delay": 3600}
        job = (await acme.post("/v1/jobs", json=later)).json()
    await stack.persister.drain()

    async with chromium_page(CHROMIUM) as page:
        await open_console(page, api.url, ADMIN, "#/jobs")
        row = f'#jobs-grid tr[data-id="{job["id"]}"]'
        await page.wait_for(f"document.querySelector('{row}')?.dataset.state === 'scheduled'")
        await page.click(f'{row} button[data-act="promote"]')
        assert await confirm(page) == f"Run job {job['id']} now?"
        assert "queued to run now" in await toast(page)
        await page.wait_for(
            f"document.querySelector('{row}').dataset.state === 'queued'", timeout=20
        )
        # a queued job has no such button; the audit names the action
        assert await page.evaluate(f"!document.querySelector('{row} button[data-act=\"promote\"]')")
        await go(page, "#/audit", "audit")
        rows = await texts(page, ".audit-grid tbody tr")
        assert "job.promote" in rows[0] and job["id"] in rows[0], rows
        assert page.errors == [], page.errors
    assert (await stack.queue.status(job["id"])).state == "queued"


async def test_empty_views_say_what_to_do(stack: Stack) -> None:
    assert CHROMIUM is not None
    async with chromium_page(CHROMIUM) as page:
        await open_console(page, stack.api.url, ADMIN)
        for fragment, view, expected in (
            ("#/jobs", "jobs", "No jobs in Postgres yet"),
            ("#/dead", "jobs", "No dead letters"),
            ("#/workers", "workers", "No worker is running"),
            ("#/audit", "audit", "No admin action yet"),
            ("#/jobs?type=nothing", "jobs", "No job matches these filters"),
            (f"#/jobs/{stack.queue.keys.new_id()}", "job", "No job"),
        ):
            await go(page, fragment, view)
            shown = await text(page, f"#view-{view} .empty")
            assert shown and expected in shown, (fragment, shown)
        await go(page, "#/workers", "workers")
        assert "jobtier worker myapp.tasks" in await text(page, "#view-workers .empty")
        assert page.errors == [], page.errors


async def test_times_are_in_the_viewers_zone(stack: Stack) -> None:
    assert CHROMIUM is not None
    async with stack.api.client() as acme:
        job = (await acme.post("/v1/jobs", json={"type": "echo", "queue": "nobody"})).json()
    await stack.persister.drain()
    async with chromium_page(CHROMIUM) as page:
        await page.call("Emulation.setTimezoneOverride", timezoneId="Asia/Tokyo")
        await open_console(page, stack.api.url, ADMIN, f"#/jobs/{job['id']}")
        await page.wait_for("document.getElementById('view-job').dataset.loaded")
        assert await text(page, "#zone") == "times in Asia/Tokyo"
        shown = await page.evaluate(
            "document.querySelector('[data-section=\"facts\"] time').getAttribute('datetime')"
        )
        label = await page.evaluate(
            "document.querySelector('[data-section=\"facts\"] time').textContent"
        )
        expected = await page.evaluate(
            f"new Intl.DateTimeFormat(undefined, {{year: 'numeric', month: 'short', day: 'numeric',"
            f" hour: '2-digit', minute: '2-digit', second: '2-digit', timeZone: 'Asia/Tokyo'}})"
            f".format(new Date({job['created_at']!r}))"
        )
        assert shown == job["created_at"]  # the instant, as the API gave it
        assert label == expected


@pytest.mark.parametrize("width", [390])
async def test_phone_width_and_the_keyboard(stack: Stack, width: int) -> None:
    assert CHROMIUM is not None
    async with stack.api.client() as acme:
        for i in range(3):
            await acme.post("/v1/jobs", json={"type": "echo", "queue": "bulk", "payload": i})
    await stack.persister.drain()
    async with chromium_page(CHROMIUM, width=width, height=844) as page:
        await open_console(page, stack.api.url, ADMIN, "#/jobs")
        await page.wait_for("document.querySelectorAll('#jobs-grid tbody tr').length === 3")
        # nothing wider than the screen: the rows are cards, each value labelled
        assert await page.evaluate("document.documentElement.scrollWidth") <= width
        assert (
            await page.evaluate(
                "getComputedStyle(document.querySelector('#jobs-grid thead')).position"
            )
            == "absolute"
        )
        # every view's link is in sight (none hidden past the edge), and no view is wider
        # than the screen
        assert await page.evaluate(
            f"[...document.querySelectorAll('#nav a')].every((a) => {{"
            f" const r = a.getBoundingClientRect(); return r.left >= 0 && r.right <= {width}; }})"
        )
        for fragment, view in (("#/dead", "jobs"), ("#/queues", "queues"),
                               ("#/workers", "workers"), ("#/audit", "audit")):  # fmt: skip
            await go(page, fragment, view)
            assert await page.evaluate("document.documentElement.scrollWidth") <= width, view
        # the keyboard reaches the queue's purge button, opens the dialog, and Escape leaves
        # it without purging; the focus comes back where it was
        await go(page, "#/queues", "queues")
        button = 'tr[data-queue="bulk"] button[data-act="purge"]'
        await page.evaluate(f"document.querySelector('{button}').focus()")
        await page.press("Enter")
        await page.wait_for("document.getElementById('confirm').open")
        assert await page.focused() == "confirm-input"  # the safe place: nothing typed yet
        await page.press("Escape")
        await page.wait_for("!document.getElementById('confirm').open")
        await page.wait_for(f"document.activeElement === document.querySelector('{button}')")
        assert (await stack.queue.admin.stats())["queues"]["bulk"]["queued"]["normal"] == 3
        # Tab moves through the console's links and buttons in order
        await page.evaluate("document.querySelector('#nav a').focus()")
        seen = [await page.focused()]
        for _ in range(5):
            await page.press("Tab")
            seen.append(await page.focused())
        assert seen[:6] == [
            "a:Overview",
            "a:Jobs",
            "a:Dead letters",
            "a:Queues",
            "a:Workers",
            "a:Audit",
        ], seen
        assert page.errors == [], page.errors


async def test_the_header_fits_one_row_its_chips_are_explained_and_the_id_hint_is_real(
    stack: Stack,
) -> None:
    """A 1280-pixel screen with a scrollbar (1265 wide) kept the header on one row only
    without the scrollbar; the process chips said nothing of what they are; the id filter's
    hint did not look like the ids of the jobs it would find."""
    stack.publish("worker", stack.persister)  # a second chip, as with a worker running
    async with stack.api.client() as acme:
        job = (await acme.post("/v1/jobs", json={"type": "echo", "queue": "nobody"})).json()
    assert CHROMIUM is not None
    async with chromium_page(CHROMIUM, width=1280, height=900) as page:
        await open_console(page, stack.api.url, ADMIN, "#/jobs")
        await page.wait_for("document.querySelectorAll('#processes .chip').length >= 2")
        one_row = (
            "(() => { const brand = document.querySelector('.brand').getBoundingClientRect();"
            " return [...document.querySelectorAll('header.top > *')].filter((e) => !e.hidden)"
            ".every((e) => e.getBoundingClientRect().top < brand.bottom); })()"
        )
        for width in (1280, 1265):
            await page.resize(width, 900)
            assert await page.evaluate(one_row), width
        titles = await page.evaluate(
            "[...document.querySelectorAll('#processes .chip')].map((c) => c.title)"
        )
        assert all(t.startswith("Reporting: ") for t in titles), titles
        assert "jobtier api" in " ".join(titles) and "jobtier worker" in " ".join(titles)
        assert await page.evaluate("document.getElementById('processes').title")
        hint = await page.evaluate("document.getElementById('f-id').placeholder")
        assert hint == job["id"][:4] + "…", (hint, job["id"])
        assert page.errors == [], page.errors
