"""Flows over HTTP and through the Python clients: one request makes a whole flow, the
parent's event stream shows its children finishing, refusals are problem documents, a
compensation is made for a job submitted over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jobtier.client import AsyncClient, Client, ValidationFailed
from jobtier.core.model import FlowJob, State
from jobtier.engine.queue import Queue
from jobtier.flows import chain, fan_in
from jobtier.scheduler import Scheduler
from jobtier.store.calls import complete_call
from tests.e2e.test_sse import read_events
from tests.fixtures.api import KEYS, ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry


def fan(children: int, key: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "jobs": [{"type": "echo", "payload": i, "ref": f"c{i}"} for i in range(children)]
        + [{"type": "collect", "payload": "parent", "after": [f"c{i}" for i in range(children)]}]
    }
    if key:
        body["idempotency_key"] = key
    return body


async def test_a_flow_in_one_request_and_the_parents_stream(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    async with api.client() as c:
        r = await c.post("/v1/flows", json=fan(30))
        assert r.status_code == 202, r.text
        answer = r.json()
        assert answer["created"] is True and len(answer["jobs"]) == 31
        parent = answer["jobs"][-1]
        assert parent["state"] == "waiting"
        assert parent["dependencies"] == {"total": 30, "done": 0, "failed": 0}
        assert all(j["state"] == "queued" and "dependencies" not in j for j in answer["jobs"][:-1])
        async with c.stream("GET", f"/v1/jobs/{parent['id']}/events") as stream:
            background.start(Scheduler(queue.store))  # it runs the resolver
            background.start(worker_for(queue, registry, concurrency=4))
            events = [e["data"] for e in await read_events(stream) if "data" in e]
        states = [e["state"] for e in events]
        assert states[0] == "waiting" and states[-3:] == ["queued", "running", "succeeded"]
        done = [e["dependencies"]["done"] for e in events]
        assert done == sorted(done) and done[-1] == 30
        assert [e["version"] for e in events] == sorted({e["version"] for e in events})
        result = (await c.get(f"/v1/jobs/{parent['id']}/result")).json()["result"]
        kids = [j["id"] for j in answer["jobs"][:-1]]
        assert result["dependencies"] == {k: ["succeeded", i, None] for i, k in enumerate(kids)}
        deps = (await c.get(f"/v1/jobs/{parent['id']}/dependencies")).json()
        assert deps["id"] == parent["id"]
        assert [(d["id"], d["state"], d["result"], d["child"]) for d in deps["dependencies"]] == [
            (k, "succeeded", i, True) for i, k in enumerate(kids)
        ]


async def test_the_parents_stream_shows_each_child_finishing(api: ApiServer, queue: Queue) -> None:
    """Children finished one at a time: every one moves the parent's document, and the
    stream carries each move."""
    from jobtier.flows.resolver import Resolver

    resolver = Resolver(queue.store)
    async with api.client() as c:
        answer = (await c.post("/v1/flows", json=fan(3))).json()
        parent = answer["jobs"][-1]["id"]
        async with c.stream("GET", f"/v1/jobs/{parent}/events") as stream:
            for child in answer["jobs"][:-1]:
                shard = queue.keys.shard_of(child["id"])
                batch = await queue.scripts.claim(shard, "w", 1, 30_000)
                (claimed,) = batch.jobs
                assert claimed.id == child["id"]  # the oldest ready job of its shard
                await queue.scripts.call(
                    *complete_call(shard, "w", 60, [(claimed.id, claimed.lease_version, b"1")])
                )
                await resolver.drain()
            await worker_for(queue, registry, burst=True).run()
            events = [e["data"] for e in await read_events(stream) if "data" in e]
    seen = [(e["state"], e["dependencies"]["done"]) for e in events]
    assert seen == [
        ("waiting", 0),
        ("waiting", 1),
        ("waiting", 2),
        ("queued", 3),
        ("running", 3),
        ("succeeded", 3),
    ]


async def test_flow_idempotency_over_http(api: ApiServer) -> None:
    async with api.client() as c:
        first = await c.post("/v1/flows", json=fan(3, "flow-key"))
        again = await c.post("/v1/flows", json=fan(3, "flow-key"))
        assert (first.status_code, again.status_code) == (202, 200)
        assert [j["id"] for j in first.json()["jobs"]] == [j["id"] for j in again.json()["jobs"]]
        assert again.json()["created"] is False
        header = await c.post("/v1/flows", json=fan(3), headers={"idempotency-key": "flow-key"})
        assert header.status_code == 200
        other = await c.post("/v1/flows", json=fan(4, "flow-key"))
        assert other.status_code == 409
        assert other.json()["job_id"] == first.json()["jobs"][-1]["id"]  # the flow's head
        differ = await c.post("/v1/flows", json=fan(3, "a"), headers={"idempotency-key": "b"})
        assert differ.status_code == 400 and differ.json()["field"] == "idempotency_key"
    async with api.client("globex") as b:  # a key is the tenant's own
        theirs = await b.post("/v1/flows", json=fan(3, "flow-key"))
        assert theirs.status_code == 202


async def test_bad_flows_are_problem_documents(start_api: StartApi, queue: Queue) -> None:
    api = await start_api(max_flow_jobs=4)
    async with api.client() as c, api.client("globex") as b:
        theirs = (await b.post("/v1/jobs", json={"type": "echo"})).json()["id"]
        cases = [
            ([{"type": "echo", "ref": "a", "after": ["b"]}, {"type": "echo", "ref": "b", "after": ["a"]}], "jobs[0].after", "cycle"),
            ([{"type": "echo", "after": ["nobody"]}], "jobs[0].after", "no job of the flow"),
            ([{"type": "echo", "depends_on": [queue.keys.new_id()]}], "jobs[0].depends_on", "not a job of yours"),
            ([{"type": "echo", "depends_on": [theirs]}], "jobs[0].depends_on", "not a job of yours"),
            ([{"type": "echo", "ref": "x"}, {"type": "echo", "ref": "x"}], "jobs[1].ref", "also jobs[0]"),
            ([{"type": "echo"}] * 5, "jobs", "at most 4"),
            ([{"type": "nope"}], "jobs[0].type", "no worker runs task"),
        ]  # fmt: skip
        for jobs, field, words in cases:
            r = await c.post("/v1/flows", json={"jobs": jobs})
            assert r.status_code == 422, r.text
            problem = r.json()
            assert r.headers["content-type"] == "application/problem+json"
            assert (problem["field"], problem["type"]) == (field, "urn:jobtier:problem:validation")
            assert words in problem["detail"], problem
        single = await c.post("/v1/jobs", json={"type": "echo", "depends_on": [theirs]})
        assert single.status_code == 422 and single.json()["field"] == "depends_on"
        batch = await c.post(
            "/v1/jobs/batch",
            json={"jobs": [{"type": "echo"}, {"type": "echo", "depends_on": [theirs]}]},
        )
        assert batch.status_code == 422 and batch.json()["field"] == "jobs[1].depends_on"
    stats = await queue.admin.stats()
    assert stats["total"]["queued"] == 1  # theirs: nothing of the refused requests was made


async def test_cancelling_a_parent_over_http(api: ApiServer, queue: Queue) -> None:
    async with api.client() as c:
        made = (await c.post("/v1/flows", json=fan(5))).json()
        parent = made["jobs"][-1]["id"]
        cancelled = await c.post(f"/v1/jobs/{parent}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        from jobtier.flows.resolver import Resolver

        await Resolver(queue.store).drain()
        for j in made["jobs"][:-1]:
            doc = (await c.get(f"/v1/jobs/{j['id']}")).json()
            assert doc["state"] == "cancelled" and doc["error"]["type"] == "ParentCancelled"


async def test_a_compensation_for_a_job_submitted_over_http(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    async with api.client("admin") as admin:
        tasks = {t["type"]: t for t in (await admin.get("/v1/admin/tasks")).json()["tasks"]}
        assert tasks["charge"]["on_failure"] == "refund"
    async with api.client() as c:
        sub = (
            await c.post(
                "/v1/jobs", json={"type": "charge", "payload": {"fail": True}, "max_attempts": 1}
            )
        ).json()
    background.start(worker_for(queue, registry))

    async def compensated() -> bool:
        comp = await queue.jobs.compensation_of(sub["id"])
        return comp is not None and (await queue.status(comp)).state is State.SUCCEEDED

    await wait_for(compensated, timeout=30)
    comp = await queue.jobs.compensation_of(sub["id"])
    assert comp is not None
    status, out = await queue.result(comp)
    assert status.type == "refund" and out["job_id"] == sub["id"]
    assert out["payload"] == {"fail": True} and out["error"]["type"] == "RuntimeError"


async def test_the_clients_submit_flows_and_read_dependencies(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    background.start(Scheduler(queue.store))
    background.start(worker_for(queue, registry))
    steps = chain(FlowJob(type="add", payload=1), FlowJob(type="add", payload=2))
    async with AsyncClient(api.url, KEYS["acme"]) as jobs:
        made = await jobs.submit_flow(steps, idempotency_key="client-chain")
        assert made.created and [j.state for j in made.jobs] == [State.QUEUED, State.WAITING]
        end = await jobs.wait(made.ids[-1], timeout=30)
        assert end.state is State.SUCCEEDED
        assert (await jobs.result(made.ids[-1])).result == 3
        deps = await jobs.dependencies(made.ids[-1])
        assert [(d.id, d.state, d.result) for d in deps] == [(made.ids[0], "succeeded", 1)]
        again = await jobs.submit_flow(steps, idempotency_key="client-chain")
        assert not again.created and again.ids == made.ids
        later = await jobs.submit("add", 10, depends_on=[made.ids[-1]])
        assert later.job.state is State.WAITING
        assert (await jobs.wait(later.id, timeout=30)).state is State.SUCCEEDED
        assert (await jobs.result(later.id)).result == 13
        with pytest.raises(ValidationFailed):
            await jobs.submit_flow([FlowJob(type="echo", ref="a", after=["a"])])

    def sync_side() -> None:
        with Client(api.url, KEYS["acme"]) as sync_jobs:
            flow = fan_in(FlowJob(type="collect"), [FlowJob(type="echo", payload=p) for p in "xy"])
            made = sync_jobs.submit_flow(flow)
            done = sync_jobs.wait(made.ids[-1], timeout=30)
            assert done.state is State.SUCCEEDED and done.dependencies is not None
            assert [d.result for d in sync_jobs.dependencies(made.ids[-1])] == ["x", "y"]

    await asyncio.to_thread(sync_side)
