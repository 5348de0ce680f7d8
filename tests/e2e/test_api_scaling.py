"""``GET /v1/admin/queues/{name}/scaling``: the desired worker count of a queue's pool, from a
real API on a real Redis with real workers; each clause of the formula (api/scaling.py) is made
to decide once. And ``jobtier queues scaling``, the same read from the terminal."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from jobtier.engine.queue import Queue
from tests.e2e.test_admin_cli import Cli
from tests.fixtures.api import ADMIN, ApiServer
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry

ROUTE = "/v1/admin/queues/{}/scaling"


async def scaling(admin: httpx.AsyncClient, name: str, **params: Any) -> dict[str, Any]:
    r = await admin.get(ROUTE.format(name), params=params)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def submit(c: httpx.AsyncClient, n: int, type: str, queue: str, payload: Any = None) -> None:
    jobs = [{"type": type, "queue": queue, "payload": payload} for _ in range(n)]
    r = await c.post("/v1/jobs/batch", json={"jobs": jobs})
    assert r.status_code == 200 and all(x["status"] == 202 for x in r.json()["results"]), r.text


async def test_demand_bounds_pause_and_limit_without_workers(api: ApiServer) -> None:
    async with api.client("admin") as admin, api.client() as c:
        # images is known by its task's advert, and empty
        s = await scaling(admin, "images")
        assert (s["desired_workers"], s["decided_by"], s["demand"]) == (0, "demand", 0)
        assert (s["live_workers"], s["slots"], s["slots_from"]) == (0, 50, "default")
        assert s["utilisation"] is None and s["oldest_age_seconds"] is None
        assert (await scaling(admin, "images", min=2))["desired_workers"] == 2
        assert (await scaling(admin, "images", min=2))["decided_by"] == "min"

        await submit(c, 7, "thumbnail", "images", {"url": "a.png"})
        s = await scaling(admin, "images", slots=3)
        # ceil(7 / 3)
        assert (s["desired_workers"], s["decided_by"], s["ready"]) == (3, "demand", 7)
        assert (s["slots"], s["slots_from"], s["demand"]) == (3, "query", 7)
        s = await scaling(admin, "images", slots=3, max=2)
        assert (s["desired_workers"], s["decided_by"], s["max"]) == (2, "max", 2)
        # no live worker and no slots given: a worker's default concurrency (50) is assumed
        s = await scaling(admin, "images")
        assert (s["desired_workers"], s["slots"], s["slots_from"]) == (1, 50, "default")
        await submit(c, 50, "thumbnail", "images", {"url": "a.png"})
        await submit(c, 50, "thumbnail", "images", {"url": "a.png"})
        s = await scaling(admin, "images")  # ceil(107 / 50), not one worker for any backlog
        assert (s["desired_workers"], s["decided_by"], s["ready"]) == (3, "demand", 107)

        # paused: its ready jobs cannot be claimed, so they ask for nobody
        assert (await admin.post("/v1/admin/queues/images/pause")).status_code == 200
        s = await scaling(admin, "images", slots=3)
        assert (s["desired_workers"], s["paused"], s["ready"], s["demand"]) == (0, True, 107, 0)
        assert (await admin.post("/v1/admin/queues/images/resume")).status_code == 200

        # a concurrency limit caps the demand: more workers than it lets run would idle
        r = await admin.put("/v1/admin/queues/images/limits", json={"concurrency": 2})
        assert r.status_code == 200
        s = await scaling(admin, "images", slots=1)
        assert (s["desired_workers"], s["demand"], s["concurrency_limit"]) == (2, 2, 2)


async def test_slots_from_live_workers_and_the_age_raise(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    async with api.client("admin") as admin, api.client() as c:
        await submit(c, 4, "wait_for_cancel", "scale")
        # three workers of one slot each: three jobs run (until cancelled), one stays ready
        for _ in range(3):
            background.start(worker_for(queue, registry, concurrency=1, queues=["scale"]))

        async def busy() -> bool:
            s = await scaling(admin, "scale", target_age=86_400)
            return bool(s["running"] == 3 and s["live_workers"] == 3)

        await wait_for(busy, timeout=30, interval=0.1)
        s = await scaling(admin, "scale", target_age=86_400)
        # ceil((1 ready + 3 running) / 1 slot): the age is far under its target
        assert (s["desired_workers"], s["decided_by"], s["demand"]) == (4, "demand", 4)
        assert (s["slots"], s["slots_from"], s["utilisation"]) == (1, "workers", 1.0)
        # the query's slots win over the workers'
        assert (await scaling(admin, "scale", slots=2, target_age=86_400))["desired_workers"] == 2

        async def waited_twice_the_target() -> bool:
            age = (await scaling(admin, "scale"))["oldest_age_seconds"]
            return age is not None and age >= 0.4

        await wait_for(waited_twice_the_target, timeout=30, interval=0.05)
        # the oldest job waited at least twice target_age: the live workers doubled (the most
        # one read raises by), over the demand's 4
        s = await scaling(admin, "scale", target_age=0.2)
        assert (s["desired_workers"], s["decided_by"], s["live_workers"]) == (6, "age", 3)
        s = await scaling(admin, "scale", target_age=0.2, max=5)
        assert (s["desired_workers"], s["decided_by"]) == (5, "max")
        # at the queue's concurrency limit, more workers could claim nothing: no age raise
        r = await admin.put("/v1/admin/queues/scale/limits", json={"concurrency": 3})
        assert r.status_code == 200
        s = await scaling(admin, "scale", target_age=0.2)
        assert (s["desired_workers"], s["decided_by"], s["demand"]) == (3, "demand", 3)
        assert (await admin.put("/v1/admin/queues/scale/limits", json={})).status_code == 200
        assert (await scaling(admin, "scale", target_age=0.2))["decided_by"] == "age"
        # paused, waiting is no reason for more workers: only the running jobs count
        assert (await admin.post("/v1/admin/queues/scale/pause")).status_code == 200
        s = await scaling(admin, "scale", target_age=0.2)
        assert (s["desired_workers"], s["decided_by"], s["demand"]) == (3, "demand", 3)
        assert (await admin.post("/v1/admin/queues/scale/resume")).status_code == 200

        # a rate limit of 1 start per 10 s lets ceil(0.1 * target_age) = 1 ready job start
        # within target_age: 5 ready ask for one slot beside the 3 running, and their age is
        # the rate's doing, so no age raise (6 without the limit)
        await submit(c, 4, "wait_for_cancel", "scale")
        limits = {"rate": 1, "per": 10}
        assert (await admin.put("/v1/admin/queues/scale/limits", json=limits)).status_code == 200
        s = await scaling(admin, "scale", target_age=0.2)
        assert (s["desired_workers"], s["decided_by"], s["ready"], s["demand"]) == (
            4,
            "rate",
            5,
            4,
        )
        assert (s["rate_per_second"], s["rate_allowance"]) == (0.1, 1)
        # over a longer target_age the rate lets every ready job start: demand decides
        s = await scaling(admin, "scale", target_age=3600)
        assert (s["desired_workers"], s["decided_by"], s["rate_allowance"]) == (8, "demand", 360)
        assert (await admin.put("/v1/admin/queues/scale/limits", json={})).status_code == 200
        s = await scaling(admin, "scale", target_age=0.2)
        assert (s["desired_workers"], s["decided_by"], s["rate_per_second"]) == (8, "demand", None)

        # blocked (a task raised RateLimited): no ready job can start, only the running count
        await queue.admin.block("scale", 600)
        s = await scaling(admin, "scale", target_age=0.2)
        assert (s["desired_workers"], s["decided_by"], s["demand"]) == (3, "blocked", 3)
        assert s["blocked_until"] is not None and s["blocked_until"] > time.time() + 500


async def test_the_oldest_age_reads_past_a_hundred_tenants(api: ApiServer, queue: Queue) -> None:
    """A claim sends the tenant it served to the back of its priority's rotation: the oldest
    ready job can belong to a tenant deeper in it than any first hundred."""

    async def put(tenant: str, n: int = 0) -> None:
        # an idempotency key picks the shard: every tenant's jobs in one rotation
        key = next(k for i in range(1000) if queue.keys.shard_for(tenant, k := f"{n}.{i}") == 0)
        await queue.submit("echo", n, queue="old", tenant=tenant, idempotency_key=key)

    await put("first")
    await put("first", 1)
    async with api.client("admin") as admin:

        async def aged() -> bool:
            age = (await scaling(admin, "old"))["oldest_age_seconds"]
            return age is not None and age >= 0.5

        await wait_for(aged, timeout=30, interval=0.05)
        for i in range(101):
            await put(f"t{i}")
        # a claim takes the first tenant's oldest job and sends it behind the 101 others
        batch = await queue.scripts.claim(0, "w", 1, 30_000, [("old", -1)], [])
        assert len(batch.jobs) == 1
        s = await scaling(admin, "old")
        assert s["ready"] == 102 and s["oldest_age_seconds"] >= 0.5, s
        ages = await queue.admin.oldest_queued(tenants=100)  # as it read before: too young
        assert ages[("old", "normal")] < 0.5


async def test_bad_requests_name_their_field_and_unknown_queues_are_404(api: ApiServer) -> None:
    async with api.client("admin") as admin, api.client() as tenant:
        assert (await tenant.get(ROUTE.format("images"))).status_code == 403
        r = await admin.get(ROUTE.format("never-named"))
        assert r.status_code == 404 and "never-named" in r.json()["detail"], r.text
        for params, status, field in [
            ({"slots": "0"}, 400, "slots"),
            ({"slots": "many"}, 400, "slots"),
            ({"min": "-1"}, 400, "min"),
            ({"max": "0"}, 400, "max"),
            ({"target_age": "nan"}, 400, "target_age"),
            ({"target_age": "0"}, 400, "target_age"),
            ({"workers": "3"}, 400, "workers"),
            ({"min": "3", "max": "2"}, 422, "min"),
        ]:
            r = await admin.get(ROUTE.format("images"), params=params)
            assert (r.status_code, r.json().get("field")) == (status, field), (params, r.text)
        r = await admin.get(ROUTE.format("no:colons"))
        assert (r.status_code, r.json()["field"]) == (422, "name")


async def test_the_cli_prints_the_number_and_its_inputs(api: ApiServer) -> None:
    async with api.client() as c:
        await submit(c, 5, "thumbnail", "images", {"url": "b.png"})
    cli = Cli(api)
    code, out, err = await cli("queues", "scaling", "images", "--slots", "2", "--json", key=ADMIN)
    assert code == 0, err
    body = json.loads(out)
    assert (body["desired_workers"], body["ready"], body["slots_from"]) == (3, 5, "query")
    code, out, err = await cli("queues", "scaling", "images", "--slots", "2", key=ADMIN)
    assert code == 0 and "desired workers" in out and "3 (by demand)" in out, (out, err)
    code, _, err = await cli("queues", "scaling", "never-named", key=ADMIN)
    assert code == 1 and "never-named" in err and "HTTP 404" in err, err
    code, _, err = await cli("queues", "scaling", "images", "--min", "4", "--max", "2", key=ADMIN)
    assert code == 1 and "min (4) is above max (2)" in err, err


async def test_the_scaled_objects_urls_are_answered_with_a_count(api: ApiServer) -> None:
    """What KEDA reads in deploy/kubernetes (each rendering's ScaledObjects): the path and
    query of its URL, answered by the API with a whole number where valueLocation points."""
    from tests.unit.test_kubernetes import RENDERINGS, rendered

    async with api.client("admin") as admin, api.client() as c:
        seen = 0
        for name in RENDERINGS:
            for so in (d for d in rendered(name) if d["kind"] == "ScaledObject"):
                for trigger in so["spec"]["triggers"]:
                    url = urlsplit(trigger["metadata"]["url"])
                    queue = url.path.split("/")[4]
                    await submit(c, 1, "echo", queue)  # known from its first job on
                    r = await admin.get(f"{url.path}?{url.query}")
                    assert r.status_code == 200, (name, url, r.text)
                    value = r.json()[trigger["metadata"]["valueLocation"]]
                    assert isinstance(value, int) and value >= 1, (name, url, r.text)
                    seen += 1
        assert seen >= 2 * len(RENDERINGS)  # a pool per queue, in the base and each overlay


async def test_the_python_client_reads_it(api: ApiServer) -> None:
    from jobtier.client import AsyncClient, NotFound

    async with api.client() as c:
        await submit(c, 3, "thumbnail", "images", {"url": "c.png"})
    async with AsyncClient(api.url, ADMIN) as admin:
        s = await admin.queue_scaling("images", slots=2, max=5)
        assert (s.desired_workers, s.ready, s.slots_from, s.max) == (2, 3, "query", 5)
        with pytest.raises(NotFound):
            await admin.queue_scaling("never-named")
