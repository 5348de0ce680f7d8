"""The console's job page says why a job has not started (``/v1/admin/jobs/{id}/explain``), in
headless Chromium against a real stack: a job of a paused queue, then, resumed and run by a
real worker, no such section any more."""

from __future__ import annotations

from tests.e2e.cdp import chromium_page
from tests.e2e.dashboard_stack import (
    CHROMIUM,
    NEEDS_CHROMIUM,
    Stack,
    open_console,
    stack_fixture,  # noqa: F401 - the `stack` fixture
    text,
    texts,
)
from tests.fixtures.api import ADMIN

pytestmark = NEEDS_CHROMIUM


async def test_a_waiting_job_says_why_and_the_section_goes_once_it_runs(stack: Stack) -> None:
    assert CHROMIUM is not None
    api = stack.api
    async with api.client() as acme, api.client("admin") as admin:
        job = (await acme.post("/v1/jobs", json={"type": "echo", "payload": 2})).json()
        assert (await admin.post("/v1/admin/queues/default/pause")).status_code == 200
    await stack.persister.drain()
    async with chromium_page(CHROMIUM) as page:
        await open_console(page, api.url, ADMIN, f"#/jobs/{job['id']}")
        await page.wait_for("document.getElementById('job-why') !== null")
        assert await text(page, "#why-position") == "Position 1 in line"
        codes = await page.evaluate(
            "[...document.querySelectorAll('#why-reasons li')].map((li) => li.dataset.code)"
        )
        assert codes == ["queue_paused", "no_worker_for_queue", "in_line"]
        reasons = await texts(page, "#why-reasons li")
        assert "queue 'default' is paused" in reasons[0]
        assert "no live worker serves queue 'default'" in reasons[1]
        assert "first in line" in reasons[2]

        # resumed, a real worker runs it: the page's status follows, and the section goes
        async with api.client("admin") as admin:
            assert (await admin.post("/v1/admin/queues/default/resume")).status_code == 200
        stack.start_worker(concurrency=2)
        await page.wait_for(
            "document.getElementById('job-why') === null"
            " && document.querySelector('#view-job .job-head .state')?.textContent === 'succeeded'",
            timeout=30,
        )
        assert page.errors == [], page.errors
