"""A flow in the console, in headless Chromium against a real stack: the operator lists the
waiting jobs, opens a parent, reads its dependencies' states and outcomes and its children
done, and follows one to its own page. Every assertion is on what the page shows."""

from __future__ import annotations

from tests.e2e.cdp import chromium_page
from tests.e2e.dashboard_stack import (
    CHROMIUM,
    NEEDS_CHROMIUM,
    Stack,
    drawn,
    open_console,
    redrawn,
    set_field,
    stack_fixture,  # noqa: F401 - the `stack` fixture
    text,
    texts,
)
from tests.fixtures.api import ADMIN
from tests.fixtures.engine import wait_for

pytestmark = NEEDS_CHROMIUM


async def test_a_parent_shows_its_dependencies_and_links_to_each(stack: Stack) -> None:
    assert CHROMIUM is not None
    async with stack.api.client() as acme:
        r = await acme.post("/v1/flows", json={"jobs": [
            {"type": "echo", "payload": {"n": 1}, "ref": "ok"},
            {"type": "fail", "payload": {"fatal": True}, "ref": "bad"},
            # a queue no worker of this test serves: it stays queued, the parent waiting
            {"type": "echo", "queue": "held", "ref": "held"},
            {"type": "collect", "after": ["ok", "bad", "held"], "on_dependency_failure": "run"},
        ]})  # fmt: skip
        assert r.status_code == 202, r.text
        ok, bad, held, parent = (j["id"] for j in r.json()["jobs"])
    worker = stack.start_worker(concurrency=2)

    async def two_done() -> bool:
        summary = (await stack.queue.status(parent)).dependencies
        return summary is not None and summary.done == 2

    await wait_for(two_done, timeout=30)
    await stack.persister.drain()

    async with chromium_page(CHROMIUM) as page:
        await open_console(page, stack.api.url, ADMIN)
        # the jobs list offers `waiting`, and shows the parent so, in its own colour
        before = await drawn(page, "jobs")
        await page.click('#nav a[data-view="jobs"]')
        before = await redrawn(page, "jobs", before)
        offered = await page.evaluate(
            "[...document.querySelectorAll('#f-state option')].map((o) => o.value)"
        )
        assert "waiting" in offered, offered
        await set_field(page, "#f-state", "waiting")
        await page.click("#f-apply")
        await redrawn(page, "jobs", before)
        rows = await texts(page, "#jobs-grid tbody tr")
        assert len(rows) == 1 and parent in rows[0], rows
        assert await text(page, "#jobs-grid tbody tr [data-col='state']") == "waiting"
        colours = await page.evaluate(
            "(() => { const c = (e) => getComputedStyle(e).color;"
            " const plain = document.createElement('span'); plain.className = 'state';"
            " document.body.append(plain);"
            " const out = [c(document.querySelector('#jobs-grid .state.s-waiting')), c(plain)];"
            " plain.remove(); return out; })()"
        )
        assert colours[0] != colours[1], colours  # not the grey of a state without colour

        # the parent: its dependencies in order, each with its state and outcome
        before = await drawn(page, "job")
        await page.click(f'#jobs-grid a[href="#/jobs/{parent}"]')
        await redrawn(page, "job", before)
        assert await text(page, '[data-section="head"] .state') == "waiting"
        heading = await page.evaluate("document.getElementById('h-flow').textContent")
        assert heading == "Dependencies (3)"
        deps = await texts(page, "#deps-grid tbody tr")
        assert [row.split()[0] for row in deps] == [ok, bad, held], deps

        async def cell(dep: str, col: str) -> str:
            return await text(page, f'#deps-grid tr[data-dep="{dep}"] [data-col="{col}"]')

        assert await cell(ok, "state") == "succeeded" and await cell(ok, "outcome") == "result"
        assert await cell(bad, "state") == "failed"
        assert (await cell(bad, "outcome")).startswith("Fatal: asked to fail for good")
        assert await cell(held, "state") == "queued"  # pending: its state now
        assert await cell(held, "outcome") == "not finished"
        badges = await page.evaluate(
            "[...document.querySelectorAll('#deps-grid [data-col=state] .state')].map((e) => e.className)"
        )
        assert badges == ["state s-succeeded", "state s-failed", "state s-queued"], badges
        assert await text(page, "#flow-children") == "children 2 / 3 done, 1 failed"

        # follows the failed one to its own page
        before = await drawn(page, "job")
        await page.click(f'#deps-grid a[href="#/jobs/{bad}"]')
        await redrawn(page, "job", before)
        assert await text(page, "#job-title") == f"Job {bad}"
        assert await text(page, '[data-section="head"] .state') == "failed"
        assert await page.evaluate("location.hash") == f"#/jobs/{bad}"
        # it waits for nothing: no dependencies shown
        assert await page.evaluate("document.querySelector('#deps-grid') === null")
        assert page.errors == [], page.errors
    worker.stop()
