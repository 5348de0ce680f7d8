"""Load shedding of batches: ``POST /v1/batches`` is judged by the batch's priority (all its
children share it), so past JOBTIER_SHED_WAITING_TOTAL a critical batch is accepted while a
low one is shed whole, and the refusal counts its children under its priority."""

from __future__ import annotations

import httpx
import pytest

from jobtier.engine.queue import Queue
from tests.e2e.test_load_shedding import waiting
from tests.fixtures.api import StartApi
from tests.fixtures.engine import wait_for

pytestmark = pytest.mark.contract

SHED_AT, CAP = 4, 50


async def batch(http: httpx.AsyncClient, priority: str, n: int) -> httpx.Response:
    body = {"type": "echo", "items": list(range(n)), "priority": priority}
    return await http.post("/v1/batches", json=body)


def refused(text: str, priority: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if line.startswith("jobtier_submits_refused_total{")
        and f'priority="{priority}"' in line
        and 'reason="shed"' in line
    ]


async def test_a_batch_is_shed_by_its_own_priority(start_api: StartApi, queue: Queue) -> None:
    api = await start_api(shed_waiting_total=SHED_AT, max_waiting_total=CAP)
    async with api.client() as http, api.client("admin") as admin:
        assert (await batch(http, "low", SHED_AT)).status_code == 202
        r = await batch(http, "critical", 3)
        assert r.status_code == 202, r.text
        r = await batch(http, "low", 3)
        assert r.status_code == 503, r.text
        assert (r.json()["type"], r.json()["priority"]) == ("urn:jobtier:problem:shed", "low")
        assert await waiting(queue) == SHED_AT + 3

        async def counted() -> bool:  # each process publishes its counters every ~2 s
            lines = refused((await admin.get("/metrics")).text, "low")
            return len(lines) == 1 and lines[0].endswith(" 3.0")

        await wait_for(counted, timeout=20)
        text = (await admin.get("/metrics")).text
        assert refused(text, "normal") == [] and refused(text, "critical") == []


async def test_only_the_priorities_named_are_shed(start_api: StartApi, queue: Queue) -> None:
    api = await start_api(shed_waiting_total=SHED_AT, max_waiting_total=CAP, shed_priorities="low")
    async with api.client() as http:
        assert (await batch(http, "normal", SHED_AT + 1)).status_code == 202
        r = await batch(http, "low", 2)
        assert r.status_code == 503 and r.json()["priority"] == "low", r.text
        assert (await batch(http, "normal", 2)).status_code == 202
        assert await waiting(queue) == SHED_AT + 3
