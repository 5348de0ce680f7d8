"""The console's circuit breakers panel in headless Chromium: a tripped breaker shows open,
the operator closes it and opens another by hand, and the audit has both."""

from __future__ import annotations

from jobtier.core.breaker import Breaker
from jobtier.store.breaker_state import BreakerStates
from tests.e2e.cdp import chromium_page
from tests.e2e.dashboard_stack import (
    CHROMIUM,
    NEEDS_CHROMIUM,
    Stack,
    confirm,
    go,
    open_console,
    stack_fixture,  # noqa: F401 - the `stack` fixture
    text,
    texts,
    toast,
)
from tests.fixtures.api import ADMIN

pytestmark = NEEDS_CHROMIUM


async def test_see_a_tripped_breaker_close_it_and_open_another(stack: Stack) -> None:
    assert CHROMIUM is not None
    states = BreakerStates(stack.queue.store)
    mail = Breaker("console-mail", failures=1, open_for=300)
    sms = Breaker("console-sms", failures=5)
    await states.record(mail, "f", "", "smtp: connection refused")  # trips it
    await states.record(sms, "f", "", "one timeout")  # known, still closed

    async with chromium_page(CHROMIUM) as page:
        await open_console(page, stack.api.url, ADMIN, "#/queues")
        await page.wait_for("document.body.dataset.view === 'queues'")
        mail_row = 'tr[data-queue="breaker:console-mail"]'
        sms_row = 'tr[data-queue="breaker:console-sms"]'
        await page.wait_for(f"!!document.querySelector('{sms_row}')")
        cells = await texts(page, f"{mail_row} td")
        assert cells[0] == "open" and "connection refused" in cells[3], cells
        assert (await texts(page, f"{sms_row} td"))[0] == "closed"

        await page.click(f'{mail_row} button[data-act="close"]')
        assert await confirm(page) == "Close breaker console-mail?"
        assert "closed" in await toast(page)
        await page.wait_for(
            f"document.querySelector('{mail_row} td')?.textContent === 'closed'", timeout=15
        )
        await page.click(f'{sms_row} button[data-act="open"]')
        assert await confirm(page) == "Open breaker console-sms?"
        assert "open" in await toast(page)
        await page.wait_for(
            f"document.querySelector('{sms_row} td')?.textContent === 'open'", timeout=15
        )
        assert await text(page, f"{sms_row} td:nth-of-type(2)") == "until closed by hand"
        assert (await states.get("console-sms")).manual

        await go(page, "#/audit", "audit")
        rows = await texts(page, ".audit-grid tbody tr")
        assert ["breaker.open" in rows[0], "breaker.close" in rows[1]] == [True, True], rows
        assert page.errors == [], page.errors
