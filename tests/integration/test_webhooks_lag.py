"""How far behind the webhook dispatchers are, on /metrics: nothing before any webhook is
accepted; once one is, the transitions no dispatcher has handled (which the logs keep in
Redis), down to 0 once a dispatcher has read them. Real API, Redis, Postgres, receiver."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from jobtier.engine.queue import Queue
from jobtier.webhooks.dispatcher import Dispatcher
from tests.fixtures.api import ApiServer
from tests.fixtures.engine import wait_for
from tests.fixtures.receiver import StartReceiver, delivered, run_jobs, secret_of


async def dispatcher_lag(admin: httpx.AsyncClient) -> tuple[float, float] | None:
    """(transitions, seconds) as /metrics shows them, or None when it shows neither."""
    r = await admin.get("/metrics")
    assert r.status_code == 200, r.text
    found = {
        s.name: s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.name.startswith("jobtier_dispatcher_lag_")
    }
    if not found:
        return None
    return found["jobtier_dispatcher_lag_transitions"], found["jobtier_dispatcher_lag_seconds"]


async def test_metrics_show_what_waits_for_the_dispatchers_once_webhooks_are_on(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    async with hook_api.client() as c, hook_api.client("admin") as admin:
        await secret_of(c)
        plain = await c.post("/v1/jobs", json={"type": "echo"})
        assert plain.status_code == 202, plain.text
        await run_jobs(queue)
        assert await dispatcher_lag(admin) is None  # no webhook accepted: nobody to wait for
        r = await c.post("/v1/jobs", json={"type": "echo", "callback": {"url": receiver.url}})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        await run_jobs(queue)  # its submit, claim and end, in the logs: no dispatcher runs
        waiting = await dispatcher_lag(admin)
        assert waiting is not None
        entries, seconds = waiting
        assert entries == 3, waiting  # the group was made at the callback's accept, not before
        assert seconds > 0, waiting
        start_dispatcher()

        async def caught_up() -> bool:
            return await dispatcher_lag(admin) == (0.0, 0.0)

        await wait_for(caught_up)
        await wait_for(lambda: delivered(c, job_id))
