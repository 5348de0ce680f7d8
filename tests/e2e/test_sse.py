"""Server-Sent Events through a real server: order, resume, heartbeats, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, cast

import httpx
import orjson

from jobtier.api.sse import PENDING, Mailbox
from jobtier.engine.queue import Queue
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry


async def read_events(response: httpx.Response, until_end: bool = True) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if line == "":
            if current:
                events.append(current)
                current = {}
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "":
            current.setdefault("comments", []).append(value)
        elif field == "data":
            current["data"] = orjson.loads(value)
        else:
            current[field] = value
    return events


async def listeners(api: ApiServer) -> int:
    async with api.client("admin") as admin:
        return int((await admin.get("/v1/admin/stats")).json()["status_reads"]["listeners"])


async def test_stream_sends_every_transition_then_ends(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "sleep", "payload": {"seconds": 0.3}})).json()
        async with c.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
            background.start(worker_for(queue, registry))
            events = [e for e in await read_events(r) if "data" in e]
    versions = [int(e["id"]) for e in events]
    assert versions == sorted(set(versions)) and versions[0] == 1
    assert [e["data"]["version"] for e in events] == versions
    states = [e["data"]["state"] for e in events]
    assert states[0] == "queued" and states[-1] == "succeeded" and "running" in states
    # progress reports are versions too: nothing between claim and success is skipped
    assert versions == list(range(1, versions[-1] + 1))
    assert all(e["event"] == "status" for e in events)


async def test_resume_with_last_event_id(api: ApiServer, queue: Queue) -> None:
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo"})).json()
        await queue.cancel(job["id"])  # version 2, terminal
        async with c.stream(
            "GET", f"/v1/jobs/{job['id']}/events", headers={"last-event-id": "1"}
        ) as r:
            events = [e for e in await read_events(r) if "data" in e]
        assert [(e["id"], e["data"]["state"]) for e in events] == [("2", "cancelled")]
        r = await c.get(f"/v1/jobs/{job['id']}/events", headers={"last-event-id": "2"})
        assert r.status_code == 204  # nothing newer, and nothing more will come
        async with c.stream(
            "GET", f"/v1/jobs/{job['id']}/events", headers={"last-event-id": "junk"}
        ) as r:
            assert [e["id"] for e in await read_events(r) if "data" in e] == ["2"]


async def test_heartbeats_and_disconnect_frees_the_listener(
    start_api: StartApi, queue: Queue
) -> None:
    api = await start_api(sse_heartbeat_seconds=0.1)
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo", "delay": 60})).json()
        comments = 0
        async with c.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
            # not closed early: that would close the connection. httpx types it AsyncIterator;
            # it is an async generator (aclose below)
            lines = cast(AsyncGenerator[str, None], r.aiter_lines())
            while comments < 3:
                if (await anext(lines)).startswith(":"):
                    comments += 1
            assert await listeners(api) == 1
            await lines.aclose()
        # the client went away: the server notices without waiting for a write to fail

        async def freed() -> bool:
            return await listeners(api) == 0

        await wait_for(freed, timeout=5)


async def test_many_streams_share_one_subscription(api: ApiServer, queue: Queue) -> None:
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo"})).json()
        streams = [c.stream("GET", f"/v1/jobs/{job['id']}/events") for _ in range(20)]
        responses = [await s.__aenter__() for s in streams]
        try:
            readers = [asyncio.create_task(read_events(r)) for r in responses]

            async def all_listening() -> bool:
                return await listeners(api) == 20

            await wait_for(all_listening)
            await queue.cancel(job["id"])
            results = await asyncio.wait_for(asyncio.gather(*readers), 10)
        finally:
            for s in streams:
                await s.__aexit__(None, None, None)
    for events in results:
        assert [e["data"]["state"] for e in events if "data" in e] == ["queued", "cancelled"]


async def test_unknown_and_foreign_jobs_are_404(api: ApiServer) -> None:
    async with api.client("acme") as acme, api.client("globex") as globex:
        job = (await acme.post("/v1/jobs", json={"type": "echo"})).json()
        assert (await globex.get(f"/v1/jobs/{job['id']}/events")).status_code == 404
        assert (await acme.get("/v1/jobs/nope/events")).status_code == 404
        assert await listeners(api) == 0


async def test_slow_client_holds_only_the_newest() -> None:
    box = Mailbox()
    for version in range(1, 1001):
        box.offer(version, "t", b"doc %d" % version)
    held = []
    while (item := await box.take(0.01)) is not None:
        held.append(item[0])
    assert len(held) <= PENDING and held[-1] == 1000
    box.offer(5, "t", b"old")  # an older version than one already taken is still new to the box
    assert (await box.take(0.01)) == (5, b"old")
