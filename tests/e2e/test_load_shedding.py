"""Load shedding: past JOBTIER_SHED_WAITING_TOTAL waiting jobs, submits of the shed
priorities (normal and low) answer 503 with Retry-After and change nothing, while critical
and high are still accepted up to JOBTIER_MAX_WAITING_TOTAL; every refusal is counted per
priority, in /metrics and on the console's dashboard frames."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from jobtier.core.errors import ConfigError
from jobtier.engine.queue import Queue
from tests.fixtures.api import StartApi
from tests.fixtures.engine import wait_for

pytestmark = pytest.mark.contract

SHED_AT, CAP = 4, 8


async def waiting(queue: Queue) -> int:
    return sum((await queue.admin.waiting_by_tenant()).values())


async def submit(http: httpx.AsyncClient, priority: str) -> httpx.Response:
    return await http.post("/v1/jobs", json={"type": "echo", "priority": priority})


async def frame(admin: httpx.AsyncClient) -> dict[str, Any]:
    """The first frame of the console's dashboard stream."""
    async with admin.stream("GET", "/v1/admin/dashboard/stream") as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data: dict[str, Any] = orjson.loads(line[6:])
                return data
    raise AssertionError("the stream ended without a frame")


async def test_low_priorities_are_shed_first_and_counted(start_api: StartApi, queue: Queue) -> None:
    api = await start_api(shed_waiting_total=SHED_AT, max_waiting_total=CAP)
    async with api.client() as http, api.client("admin") as admin:
        for _ in range(SHED_AT):
            assert (await submit(http, "low")).status_code == 202
        for priority in ("normal", "low"):
            r = await submit(http, priority)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "5"
            problem = r.json()
            assert problem["type"] == "urn:jobtier:problem:shed"
            assert problem["priority"] == priority
            assert "JOBTIER_SHED_WAITING_TOTAL" in problem["detail"]
        # a batch holding one shed job is refused whole: nothing of it is created
        batch = {"jobs": [{"type": "echo", "priority": "high"}, {"type": "echo"}]}
        r = await http.post("/v1/jobs/batch", json=batch)
        assert r.status_code == 503 and r.json()["priority"] == "normal"
        # and a flow likewise
        flow = {
            "jobs": [
                {"type": "echo", "priority": "critical", "ref": "a"},
                {"type": "echo", "priority": "low", "after": ["a"]},
            ]
        }
        r = await http.post("/v1/flows", json=flow)
        assert r.status_code == 503 and r.json()["priority"] == "low"
        assert await waiting(queue) == SHED_AT
        # critical and high go on, up to the hard limit, which refuses them too
        for i in range(CAP - SHED_AT):
            r = await submit(http, "critical" if i % 2 else "high")
            assert r.status_code == 202, r.text
        r = await submit(http, "critical")
        assert r.status_code == 503 and r.json()["type"] == "urn:jobtier:problem:overloaded"
        assert await waiting(queue) == CAP

        # jobs refused: normal 1 + 1 (the batch's), low 1 + 1 (the flow's), high 1 (the
        # batch's) and critical 1 (the flow's) shed; one critical over the hard limit
        want = {
            "shed": {"normal": 2.0, "low": 2.0, "high": 1.0, "critical": 1.0},
            "overloaded": {"critical": 1.0},
        }

        async def published() -> bool:  # each process publishes its counters every ~2 s
            return (await frame(admin)).get("submits_refused") == want

        await wait_for(published, timeout=20)
        text = (await admin.get("/metrics")).text
        shed_low = [
            line
            for line in text.splitlines()
            if line.startswith("jobtier_submits_refused_total{")
            and 'priority="low"' in line
            and 'reason="shed"' in line
        ]
        assert len(shed_low) == 1 and shed_low[0].endswith(" 2.0"), shed_low


async def test_shedding_is_off_by_default(start_api: StartApi, queue: Queue) -> None:
    api = await start_api(max_waiting_total=3)
    async with api.client() as http:
        for _ in range(3):
            assert (await submit(http, "low")).status_code == 202
        r = await submit(http, "critical")  # the single threshold: every priority alike
        assert r.status_code == 503 and r.json()["type"] == "urn:jobtier:problem:overloaded"


async def test_bad_shedding_settings_are_refused(start_api: StartApi) -> None:
    with pytest.raises(ConfigError, match="JOBTIER_SHED_PRIORITIES"):
        await start_api(shed_priorities="low,urgent")
    with pytest.raises(ConfigError, match="JOBTIER_SHED_WAITING_TOTAL"):
        await start_api(shed_waiting_total=10, max_waiting_total=5)
