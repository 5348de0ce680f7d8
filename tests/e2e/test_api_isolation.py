"""Tenant isolation, route by route, for every route ``/v1/openapi.json`` lists.

The document is read at test time, so a route added later is probed too; a route the table
below does not classify fails the test (classify it: nobody forgets a new route). Each
route is probed with no key and a wrong key (401), a tenant key on admin routes (403), and
tenant B's key on tenant A's job and schedule (404 exactly as for an unknown id, and
nothing changes for A).
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.engine.queue import Queue
from tests.fixtures.api import ApiServer, StartApi

# how each route is probed; a route missing here fails the test
TENANT_ITEM = "tenant item"  # path names one of the tenant's jobs or schedules
TENANT_LIST = "tenant list"  # lists the tenant's own things
TENANT_CREATE = "tenant create"  # makes a thing of the tenant's
ADMIN = "admin"  # admin key only
WORKER = "worker"  # a worker key only (JOBTIER_WORKER_KEYS): a tenant's is refused, as on admin
PUBLIC = "public"  # no key needed
ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1/jobs"): TENANT_CREATE,
    ("GET", "/v1/jobs"): TENANT_LIST,
    ("POST", "/v1/jobs/batch"): TENANT_CREATE,
    ("POST", "/v1/flows"): TENANT_CREATE,
    ("GET", "/v1/jobs/{job_id}"): TENANT_ITEM,
    ("GET", "/v1/jobs/{job_id}/result"): TENANT_ITEM,
    ("POST", "/v1/jobs/{job_id}/cancel"): TENANT_ITEM,
    ("GET", "/v1/jobs/{job_id}/events"): TENANT_ITEM,
    ("GET", "/v1/jobs/{job_id}/history"): TENANT_ITEM,
    ("GET", "/v1/jobs/{job_id}/dependencies"): TENANT_ITEM,
    ("GET", "/v1/jobs/{job_id}/logs"): TENANT_ITEM,
    ("GET", "/v1/jobs/{job_id}/checkpoint"): TENANT_ITEM,
    ("GET", "/v1/jobs/{job_id}/explain"): TENANT_ITEM,
    ("POST", "/v1/jobs/{job_id}/retry"): TENANT_ITEM,
    ("POST", "/v1/jobs/{job_id}/promote"): TENANT_ITEM,
    ("POST", "/v1/jobs/{job_id}/priority"): TENANT_ITEM,
    ("POST", "/v1/schedules"): TENANT_CREATE,
    ("GET", "/v1/schedules"): TENANT_LIST,
    ("GET", "/v1/schedules/{schedule_id}"): TENANT_ITEM,
    ("DELETE", "/v1/schedules/{schedule_id}"): TENANT_ITEM,
    ("POST", "/v1/schedules/{schedule_id}/pause"): TENANT_ITEM,
    ("POST", "/v1/schedules/{schedule_id}/resume"): TENANT_ITEM,
    ("PATCH", "/v1/schedules/{schedule_id}"): TENANT_ITEM,
    ("POST", "/v1/schedules/{schedule_id}/run"): TENANT_ITEM,
    ("GET", "/v1/jobs/{job_id}/deliveries"): TENANT_ITEM,
    ("GET", "/v1/jobs/{job_id}/result/content"): TENANT_ITEM,
    ("POST", "/v1/webhooks"): TENANT_CREATE,
    ("GET", "/v1/webhooks"): TENANT_LIST,
    ("GET", "/v1/webhooks/{webhook_id}"): TENANT_ITEM,
    ("DELETE", "/v1/webhooks/{webhook_id}"): TENANT_ITEM,
    ("GET", "/v1/webhooks/{webhook_id}/deliveries"): TENANT_ITEM,
    ("POST", "/v1/webhook-secret"): TENANT_CREATE,
    ("POST", "/v1/batches"): TENANT_CREATE,
    ("GET", "/v1/batches/{batch_id}"): TENANT_ITEM,
    ("POST", "/v1/batches/{batch_id}/cancel"): TENANT_ITEM,
    ("POST", "/v1/batches/{batch_id}/retry"): TENANT_ITEM,
    ("GET", "/v1/admin/dead-letters"): ADMIN,
    ("POST", "/v1/admin/dead-letters/replay"): ADMIN,
    ("POST", "/v1/admin/dead-letters/{job_id}/replay"): ADMIN,
    ("GET", "/v1/admin/dead-letters/{job_id}"): ADMIN,
    ("GET", "/v1/admin/stats"): ADMIN,
    ("GET", "/v1/admin/dashboard/stream"): ADMIN,
    ("GET", "/v1/admin/queues"): ADMIN,
    ("POST", "/v1/admin/queues/{name}/pause"): ADMIN,
    ("POST", "/v1/admin/queues/{name}/resume"): ADMIN,
    ("POST", "/v1/admin/queues/{name}/unblock"): ADMIN,
    ("PUT", "/v1/admin/queues/{name}/limits"): ADMIN,
    ("GET", "/v1/admin/queues/{name}/scaling"): ADMIN,
    ("GET", "/v1/admin/tasks"): ADMIN,
    ("GET", "/v1/admin/jobs"): ADMIN,
    ("GET", "/v1/admin/jobs/{job_id}"): ADMIN,
    ("GET", "/v1/admin/jobs/{job_id}/explain"): ADMIN,
    ("GET", "/v1/admin/jobs/{job_id}/payload"): ADMIN,
    ("GET", "/v1/admin/jobs/{job_id}/result"): ADMIN,
    ("POST", "/v1/admin/jobs/{job_id}/cancel"): ADMIN,
    ("POST", "/v1/admin/jobs/{job_id}/promote"): ADMIN,
    ("POST", "/v1/admin/queues/{name}/purge"): ADMIN,
    ("GET", "/v1/admin/workers"): ADMIN,
    ("GET", "/v1/admin/events"): ADMIN,
    ("GET", "/v1/admin/audit"): ADMIN,
    ("GET", "/v1/admin/breakers"): ADMIN,
    ("POST", "/v1/admin/breakers/{name}/open"): ADMIN,
    ("POST", "/v1/admin/breakers/{name}/close"): ADMIN,
    ("GET", "/metrics"): ADMIN,
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/dashboard"): PUBLIC,
    ("GET", "/v1/openapi.json"): PUBLIC,
    ("PUT", "/v1/worker/tasks"): WORKER,
    ("POST", "/v1/worker/claim"): WORKER,
    ("POST", "/v1/worker/leave"): WORKER,
    ("POST", "/v1/worker/complete"): WORKER,
    ("POST", "/v1/worker/jobs/{job_id}/heartbeat"): WORKER,
    ("POST", "/v1/worker/jobs/{job_id}/progress"): WORKER,
    ("POST", "/v1/worker/jobs/{job_id}/logs"): WORKER,
    ("POST", "/v1/worker/jobs/{job_id}/complete"): WORKER,
    ("POST", "/v1/worker/jobs/{job_id}/fail"): WORKER,
    ("POST", "/v1/worker/jobs/{job_id}/stopped"): WORKER,
}
WRONG_KEY = {"authorization": "Bearer no-such-key"}
IDEMPOTENCY_KEY = "shared-key-1"
SCHEDULE = {"name": "nightly", "type": "echo", "cron": "0 3 * * *"}
BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/v1/jobs"): {"type": "echo", "idempotency_key": IDEMPOTENCY_KEY},
    ("POST", "/v1/jobs/batch"): {"jobs": [{"type": "echo", "idempotency_key": IDEMPOTENCY_KEY}]},
    ("POST", "/v1/flows"): {
        "jobs": [{"type": "echo", "ref": "a"}, {"type": "echo", "after": ["a"]}],
        "idempotency_key": "shared-flow-key",  # keys are shared by jobs and flows
    },
    ("POST", "/v1/schedules"): SCHEDULE,
    ("PATCH", "/v1/schedules/{schedule_id}"): {"payload": {"changed": True}},
    ("POST", "/v1/jobs/{job_id}/priority"): {"priority": "critical"},
    ("POST", "/v1/batches"): {"type": "echo", "items": [{"n": 1}, {"n": 2}]},
    ("POST", "/v1/admin/dead-letters/replay"): {"all": True},
    ("POST", "/v1/webhooks"): {"url": "http://127.0.0.1:9/hook"},  # allowed below, never sent
}


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(
        PostgresExtension(pg_settings),
        database_url=pg_settings.database_url,
        webhook_allowed_hosts="127.0.0.1",  # no dispatcher runs: nothing is sent
    )


def fill(path: str, values: dict[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        assert name in values, f"{path}: no value for the path parameter {name!r}"
        return values[name]

    return re.sub(r"\{(\w+)\}", value, path)


async def call(c: httpx.AsyncClient, method: str, path: str, body: Any = None) -> httpx.Response:
    if path.endswith(("/events", "/stream")):
        # a stream that would open is answered by its status line; do not wait for events
        async with c.stream(method, path) as r:
            if r.status_code != 200:
                await r.aread()
            return r
    return await c.request(method, path, json=body)


def assert_problem(r: httpx.Response, status: int, slug: str, what: str) -> dict[str, Any]:
    assert r.status_code == status, f"{what}: {r.status_code} {r.text[:300]}"
    assert r.headers["content-type"] == "application/problem+json", what
    doc: dict[str, Any] = r.json()
    assert doc["type"] == f"urn:jobtier:problem:{slug}", what
    return doc


async def tenant_a_state(a: httpx.AsyncClient, ids: dict[str, str]) -> Any:
    """What tenant A sees of its job, schedule and batch: a probe by B must change none of it."""
    job = (await a.get(f"/v1/jobs/{ids['job_id']}")).json()
    schedule = (await a.get(f"/v1/schedules/{ids['schedule_id']}")).json()
    webhooks = (await a.get("/v1/webhooks")).json()
    batch = (await a.get(f"/v1/batches/{ids['batch_id']}")).json()
    return job, schedule, webhooks, batch


async def test_every_route_is_isolated_by_tenant(pg_api: ApiServer, queue: Queue) -> None:
    async with pg_api.client(None) as anonymous:
        doc = (await anonymous.get("/v1/openapi.json")).json()
    operations = [(m.upper(), p) for p, item in doc["paths"].items() for m in item]
    unclassified = sorted(set(operations) - set(ROUTES))
    assert not unclassified, f"classify these routes in ROUTES: {unclassified}"
    assert set(ROUTES) <= set(operations), "ROUTES lists routes the document no longer has"

    async with (
        pg_api.client("acme") as a,
        pg_api.client("globex") as b,
        pg_api.client(None) as nobody,
        pg_api.client("admin") as admin,
        httpx.AsyncClient(base_url=pg_api.url, headers=WRONG_KEY, timeout=30) as stranger,
    ):
        job = (await a.post("/v1/jobs", json=BODIES[("POST", "/v1/jobs")])).json()
        made = await a.post("/v1/schedules", json=SCHEDULE)
        assert made.status_code == 201, made.text
        schedule = made.json()
        hook = await a.post("/v1/webhooks", json=BODIES[("POST", "/v1/webhooks")])
        assert hook.status_code == 201, hook.text
        batch = await a.post("/v1/batches", json=BODIES[("POST", "/v1/batches")])
        assert batch.status_code == 202, batch.text
        a_ids = {
            "job_id": job["id"], "schedule_id": schedule["id"], "name": "default",
            "webhook_id": hook.json()["id"], "batch_id": batch.json()["id"],
        }  # fmt: skip
        unknown_ids = {
            "job_id": queue.keys.new_id(),
            "schedule_id": "01M8KK4FZ54RBHFVYBN6HBV0CZ",
            "name": "none",
            "webhook_id": "wh_01M8KK4FZ54RBHFVYBN6HBV0ZZ",
            "batch_id": queue.keys.new_id(),
        }
        before = await tenant_a_state(a, a_ids)

        for method, template in operations:
            kind = ROUTES[(method, template)]
            what = f"{method} {template}"
            path = fill(template, a_ids)
            body = BODIES.get((method, template))
            if kind == PUBLIC:
                assert (await call(nobody, method, path)).status_code == 200, what
                continue
            # (this API has no worker keys: a worker route's 401 says so)
            not_a_key = "set JOBTIER_WORKER_KEYS" if kind == WORKER else "unknown API key"
            for client, detail in ((nobody, "send an API key"), (stranger, not_a_key)):
                problem = assert_problem(
                    await call(client, method, path, body), 401, "unauthorized", what
                )
                assert detail in problem["detail"], what
            if kind not in (ADMIN, WORKER):
                # a tenant's route: the admin key is known, but no tenant's (403, not 401)
                problem = assert_problem(
                    await call(admin, method, path, body), 403, "forbidden", what
                )
                assert "not the admin key" in problem["detail"], what
            if kind in (ADMIN, WORKER):
                for client in (a, b):
                    assert_problem(await call(client, method, path, body), 403, "forbidden", what)
            elif kind == TENANT_ITEM:
                # B on A's id answers exactly as on an id nobody has
                foreign = await call(b, method, path, body)
                unknown = await call(b, method, fill(template, unknown_ids), body)
                got = assert_problem(foreign, 404, "not-found", what)
                expected = assert_problem(unknown, 404, "not-found", what)
                for name in a_ids:  # the unknown id named in the problem, as A's
                    for member, value in expected.items():
                        if isinstance(value, str):
                            expected[member] = value.replace(unknown_ids[name], a_ids[name])
                assert got == expected, what
            elif kind == TENANT_LIST:
                r = await b.request(method, path)
                assert r.status_code == 200, what
                assert not set(a_ids.values()) & set(
                    re.findall(r"[0-9A-Z]{26}(?:-\d+)?", r.text)
                ), what
                assert a_ids["webhook_id"] not in r.text, what
            elif kind == TENANT_CREATE:
                # B's thing of the same name (idempotency key, schedule name) is B's own
                r = await b.request(method, path, json=body)
                assert r.status_code < 300, f"{what}: {r.text}"
                assert not [i for i in a_ids.values() if len(i) > 10 and i in r.text], what
            else:  # pragma: no cover - a kind added above without a probe
                raise AssertionError(f"{what}: no probe for {kind!r}")
            assert await tenant_a_state(a, a_ids) == before, what
