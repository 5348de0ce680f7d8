"""The console's load-shedding tile in headless Chromium: the submits shed, by priority."""

from __future__ import annotations

from tests.e2e.cdp import chromium_page
from tests.e2e.dashboard_stack import CHROMIUM, NEEDS_CHROMIUM, log_in, text
from tests.e2e.test_load_shedding import CAP, submit
from tests.fixtures.api import ADMIN, StartApi

pytestmark = NEEDS_CHROMIUM


async def test_the_console_shows_the_shed_submits_by_priority(start_api: StartApi) -> None:
    api = await start_api(shed_waiting_total=1, max_waiting_total=CAP)
    async with api.client() as http:
        assert (await submit(http, "high")).status_code == 202
        for priority in ("normal", "low", "low"):
            assert (await submit(http, priority)).status_code == 503
    assert CHROMIUM is not None
    async with chromium_page(CHROMIUM) as page:
        await page.goto(f"{api.url}/dashboard")
        await log_in(page, ADMIN)
        # the API publishes its counters every ~2 s: the page shows them once they arrive
        await page.wait_for("document.getElementById('shed-total').dataset.value === '3'")
        assert await text(page, "#shed-split") == "critical 0 · high 0 · normal 1 · low 2"
        assert await text(page, "#refused-other") == "0"
        assert page.errors == []
