"""The console's job detail (``GET /v1/admin/jobs/{id}``) shows a job's flow, whatever its
tenant: each job it waits for with its state (a pending one's state now), its error's type
or whether it left a result, and a parent's children done; from Redis while it holds the
job, from Postgres after."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.scheduler import Scheduler
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry

FATAL = {"fatal": True}


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)


@pytest.fixture
async def persister(pg_settings: Settings, queue: Queue, pg_pool: Pool) -> AsyncIterator[Persister]:
    yield Persister(pg_settings, queue.redis, pg_pool, "console-flows-persister")


def flow(earlier: str) -> dict[str, Any]:
    """A parent of three children (one returns a value, one nothing, one fails for good) and
    of an earlier job, run whatever they end as; and a chain whose first step fails."""
    return {
        "jobs": [
            {"type": "echo", "payload": {"n": 1}, "ref": "c0"},
            {"type": "echo", "payload": None, "ref": "c1"},
            {"type": "fail", "payload": FATAL, "ref": "c2"},
            {"type": "collect", "payload": "parent", "after": ["c0", "c1", "c2"],
             "depends_on": [earlier], "on_dependency_failure": "run"},
            {"type": "fail", "payload": FATAL, "ref": "a"},
            {"type": "echo", "payload": "b", "ref": "b", "after": ["a"]},
            {"type": "echo", "payload": "c", "after": ["b"]},
        ]
    }  # fmt: skip


def outline(detail: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (d["id"], d["state"], d.get("now"), d["child"], d.get("error"), d["result"])
        for d in detail["dependencies"]
    ]


async def test_a_parents_children_and_a_chains_failed_step(
    pg_api: ApiServer, queue: Queue, persister: Persister, background: Background
) -> None:
    async with pg_api.client() as acme, pg_api.client("admin") as admin:
        earlier = (await acme.post("/v1/jobs", json={"type": "echo", "payload": "e"})).json()
        r = await acme.post("/v1/flows", json=flow(earlier["id"]))
        assert r.status_code == 202, r.text
        c0, c1, c2, parent, a, b, c = (j["id"] for j in r.json()["jobs"])

        async def detail(job_id: str) -> dict[str, Any]:
            r = await admin.get(f"/v1/admin/jobs/{job_id}")
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            return body

        # before anything ran: every dependency pending, each in the state it is in now
        before = await detail(parent)
        assert before["tenant"] == "acme" and before["job"]["state"] == "waiting"
        assert outline(before) == [
            (c0, "pending", "queued", True, None, False),
            (c1, "pending", "queued", True, None, False),
            (c2, "pending", "queued", True, None, False),
            (earlier["id"], "pending", "queued", False, None, False),
        ]
        assert before["children"] == {"total": 3, "done": 0, "failed": 0}
        # the chain's last step waits for one that waits itself
        assert outline(await detail(c)) == [(b, "pending", "waiting", True, None, False)]
        plain = await detail(earlier["id"])
        assert plain["dependencies"] == [] and plain["children"] is None

        background.start(Scheduler(queue.store))  # it runs the resolver
        background.start(worker_for(queue, registry, concurrency=4))

        async def ended() -> bool:
            states = [(await queue.status(j)).state for j in (parent, c)]
            return all(s in ("succeeded", "failed", "cancelled") for s in states)

        await wait_for(ended, timeout=30)

        after = await detail(parent)
        assert after["job"]["state"] == "succeeded" and after["source"] == "redis"
        fatal = {"type": "Fatal", "message": "asked to fail for good (attempt 1)"}
        expected = [
            (c0, "succeeded", None, True, None, True),
            (c1, "succeeded", None, True, None, False),  # it returned nothing
            (c2, "failed", None, True, fatal, False),  # the type and message, no traceback
            (earlier["id"], "succeeded", None, False, None, True),
        ]
        assert outline(after) == expected
        assert after["children"] == {"total": 3, "done": 3, "failed": 1}
        # a chain: its step after the failed one is cancelled, and says why
        chained = await detail(b)
        assert chained["job"]["state"] == "cancelled"
        assert outline(chained) == [(a, "failed", None, True, fatal, False)]
        last = await detail(c)
        ((dep_id, state, now, child, error, result),) = outline(last)
        assert (dep_id, state, now, child, result) == (b, "cancelled", None, True, False)
        assert error is not None and error["type"]

        # Redis forgets the parent (retention): Postgres has the same flow
        await persister.drain()
        await queue.redis.delete(queue.keys.job(parent), queue.keys.deps(parent))
        late = await detail(parent)
        assert late["source"] == "postgres"
        assert outline(late) == expected and late["children"] == after["children"]

        # the admin key only; any other answers as for any admin route
        assert (await acme.get(f"/v1/admin/jobs/{parent}")).status_code == 403
