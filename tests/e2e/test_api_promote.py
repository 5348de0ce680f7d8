"""``POST /v1/jobs/{id}/promote``, the clients' ``promote`` and ``jobtier jobs promote``
against a real API (loopback uvicorn, Redis)."""

from __future__ import annotations

import asyncio

import pytest

from jobtier.client import AsyncClient, Client, WrongState
from tests.e2e.test_admin_cli import Cli
from tests.fixtures.api import KEYS, ApiServer

SCHEDULED = {"type": "echo", "payload": {"n": 1}, "delay": 3600}


async def test_promote_a_delayed_job(api: ApiServer) -> None:
    async with api.client() as c, api.client("globex") as globex:
        job = (await c.post("/v1/jobs", json=SCHEDULED)).json()
        assert job["state"] == "scheduled"
        assert (await globex.post(f"/v1/jobs/{job['id']}/promote")).status_code == 404
        r = await c.post(f"/v1/jobs/{job['id']}/promote")
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["state"] == "queued" and got["version"] == job["version"] + 1
        assert got["run_at"] < job["run_at"]  # now, not in an hour
        again = await c.post(f"/v1/jobs/{job['id']}/promote")
        assert again.status_code == 409 and again.json()["type"].endswith("wrong-state")
        assert "only a scheduled job is promoted" in again.json()["detail"]
        assert again.json()["job"] == got  # its status, unchanged
        missing = "01ARZ3NDEKTSV4RRFFQ69G5FAV"
        assert (await c.post(f"/v1/jobs/{missing}/promote")).status_code == 404
        assert (await c.post("/v1/jobs/not-an-id/promote")).status_code in (400, 404)


async def test_clients_and_the_cli_promote(api: ApiServer) -> None:
    async with api.client() as c:
        ids = [(await c.post("/v1/jobs", json=SCHEDULED)).json()["id"] for _ in range(3)]
    async with AsyncClient(api.url, KEYS["acme"]) as client:
        assert (await client.promote(ids[0])).state == "queued"
        with pytest.raises(WrongState) as refused:
            await client.promote(ids[0])
        assert refused.value.status == 409

    def sync_use() -> str:
        with Client(api.url, KEYS["acme"]) as client:
            return client.promote(ids[1]).state

    assert await asyncio.to_thread(sync_use) == "queued"
    cli = Cli(api)
    code, out, err = await cli("jobs", "promote", ids[2])
    assert code == 0 and out.strip() == f"{ids[2]}: queued now (was scheduled)", err
    code, _, err = await cli("jobs", "promote", ids[2])
    assert code == 1 and "not scheduled" in err and "HTTP 409" in err


async def test_change_a_waiting_jobs_priority(api: ApiServer) -> None:
    async with api.client() as c, api.client("globex") as globex:
        job = (await c.post("/v1/jobs", json=SCHEDULED)).json()
        where = f"/v1/jobs/{job['id']}/priority"
        assert (await globex.post(where, json={"priority": "high"})).status_code == 404
        r = await c.post(where, json={"priority": "critical"})
        assert r.status_code == 200, r.text
        assert (r.json()["priority"], r.json()["state"]) == ("critical", "scheduled")
        for body, field in (({"priority": "urgent"}, "priority"), ({}, "priority")):
            bad = await c.post(where, json=body)
            assert bad.status_code == 422 and bad.json()["field"] == field, bad.text
        assert (await c.get(f"/v1/jobs/{job['id']}")).json()["priority"] == "critical"
        await c.post(f"/v1/jobs/{job['id']}/cancel")
        ended = await c.post(where, json={"priority": "low"})
        assert ended.status_code == 409 and "only a job not started yet" in ended.json()["detail"]

    async with AsyncClient(api.url, KEYS["acme"]) as client:
        other = (await client.submit("echo", None, delay=3600)).job.id
        assert (await client.set_priority(other, "low")).priority == "low"
    cli = Cli(api)
    code, out, err = await cli("jobs", "priority", other, "high")
    assert code == 0 and out.strip() == f"{other}: scheduled at priority high", err
    code, _, err = await cli("jobs", "priority", other, "urgent")
    assert code == 2 and "invalid choice" in err
