"""The console's routes, usable without the page: every tenant's jobs by filter, one job in
full, admin cancel and purge (audited), the audit itself (deferred while Postgres is down),
live workers and the followed-jobs event stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest

from jobtier.api.audit import fingerprint
from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.core.model import encode_json
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.store.calls import fail_call
from tests import debug_tasks
from tests.fixtures.api import ADMIN, ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import big_rows, registry

TRACEBACK = (
    'Traceback (most recent call last):\n  File "tasks.py", line 12, in resize\n'
    '    raise ValueError("no such image")\nValueError: no such image\n'
)


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)


@pytest.fixture
async def persister(pg_settings: Settings, queue: Queue, pg_pool: Pool) -> AsyncIterator[Persister]:
    yield Persister(pg_settings, queue.redis, pg_pool, "console-persister")


async def fail_with_traceback(queue: Queue, job_id: str, worker: str = "w-test") -> None:
    """Run one attempt of a waiting job of queue `tb` as a worker would, failing it for good
    with an error that carries a traceback (as workers that record one send it)."""
    shard = queue.keys.shard_of(job_id)
    batch = await queue.scripts.claim(shard, worker, 1, 30_000, queues=[("tb", -1)])
    (job,) = batch.jobs
    assert job.id == job_id
    error = json.dumps({"type": "ValueError", "message": "no such image", "traceback": TRACEBACK})
    call = fail_call(shard, worker, 3600, [(job_id, job.lease_version, error, -1)])
    assert await queue.scripts.call(*call) == [0, b"failed"]


async def test_every_tenants_jobs_by_each_filter(
    pg_api: ApiServer, queue: Queue, persister: Persister
) -> None:
    async with (
        pg_api.client() as acme,
        pg_api.client("globex") as globex,
        pg_api.client("admin") as admin,
    ):
        a = [
            (await acme.post("/v1/jobs", json={"type": "echo", "payload": i})).json()
            for i in range(6)
        ]
        g = [
            (await globex.post("/v1/jobs", json={"type": "sleep", "queue": "slow"})).json()
            for _ in range(4)
        ]
        dead = (
            await acme.post("/v1/jobs", json={"type": "fail", "payload": {"fatal": True}})
        ).json()
        await worker_for(queue, registry, burst=True, queues=["default"]).run()
        await persister.drain()

        async def ids(query: str) -> list[str]:
            r = await admin.get(f"/v1/admin/jobs?{query}")
            assert r.status_code == 200, r.text
            page = r.json()
            assert set(page["lag"]) == {"transitions", "seconds"}
            return [item["job"]["id"] for item in page["jobs"]]

        everything = [j["id"] for j in [*a, *g, dead]]
        listed = await ids("limit=100")
        assert sorted(listed) == sorted(everything)
        # newest first: created_at descending (ties broken by id)
        page = (await admin.get("/v1/admin/jobs?limit=100")).json()["jobs"]
        created = [(item["job"]["created_at"], item["job"]["id"]) for item in page]
        assert created == sorted(created, reverse=True)
        assert {item["tenant"] for item in page} == {"acme", "globex"}
        assert await ids("state=failed") == [dead["id"]]
        assert sorted(await ids("tenant=globex")) == sorted(j["id"] for j in g)
        assert sorted(await ids("queue=slow")) == sorted(j["id"] for j in g)
        assert sorted(await ids("type=sleep&state=queued")) == sorted(j["id"] for j in g)
        assert await ids("tenant=acme&state=queued") == []
        assert await ids(f"id_prefix={dead['id'][:-2].lower()}") == [dead["id"]]
        assert await ids(f"id_prefix={dead['id']}") == [dead["id"]]
        # the time range, on created_at
        first = min(datetime.fromisoformat(j["created_at"]) for j in [*a, *g, dead])
        before = (first - timedelta(seconds=1)).isoformat()
        assert await ids(f"created_before={before.replace('+', '%2B')}") == []
        assert sorted(await ids(f"created_after={before.replace('+', '%2B')}")) == sorted(
            everything
        )
        # keyset pages: every job once, whatever the page size and order
        for order in ("desc", "asc"):
            seen, cursor = [], None
            while True:
                url = f"/v1/admin/jobs?limit=3&order={order}" + (
                    f"&cursor={cursor}" if cursor else ""
                )
                body = (await admin.get(url)).json()
                seen += [item["job"]["id"] for item in body["jobs"]]
                if not (cursor := body["next_cursor"]):
                    break
            assert sorted(seen) == sorted(everything) and len(seen) == len(everything)
        for bad in ("state=done", "id_prefix=no!", "tenant=a%20b", "limit=0", "cursor=x!",
                    "created_before=soon", "colour=red"):  # fmt: skip
            r = await admin.get(f"/v1/admin/jobs?{bad}")
            assert (
                r.status_code == 400 and r.headers["content-type"] == "application/problem+json"
            ), bad
        assert (await acme.get("/v1/admin/jobs")).status_code == 403


async def test_one_job_in_full_with_its_traceback_payload_and_result(
    pg_api: ApiServer, queue: Queue, persister: Persister
) -> None:
    async with pg_api.client() as acme, pg_api.client("admin") as admin:
        job = (
            await acme.post(
                "/v1/jobs", json={"type": "echo", "payload": {"x": [1, 2]}, "queue": "tb"}
            )
        ).json()
        await fail_with_traceback(queue, job["id"])
        big = (await acme.post("/v1/jobs", json={"type": "echo", "payload": "y" * 70_000})).json()
        await worker_for(queue, registry, burst=True, queues=["default"]).run()

        # not yet in Postgres: the live job from Redis, an empty history (the lag, cached for
        # a second, says how far behind Postgres is)
        early = (await admin.get(f"/v1/admin/jobs/{job['id']}")).json()
        assert early["source"] == "redis" and early["tenant"] == "acme"
        assert early["job"]["state"] == "failed"
        assert early["job"]["error"]["traceback"] == TRACEBACK  # the document keeps it all
        assert early["history"] == [] and set(early["lag"]) == {"transitions", "seconds"}
        assert early["payload"] == {
            "size": len(b'{"x":[1,2]}'),
            "value": {"x": [1, 2]},
            "truncated": False,
        }
        assert early["result"] == {"size": None, "value": None, "truncated": False, "ref": None}
        assert early["lines"] == []  # it logged nothing

        await persister.drain()
        full = (await admin.get(f"/v1/admin/jobs/{job['id']}")).json()
        steps = [(t["from_state"], t["to_state"], t["attempt"]) for t in full["history"]]
        assert steps == [(None, "queued", 0), ("queued", "running", 1), ("running", "failed", 1)]
        assert full["history"][2]["worker"] == "w-test"
        assert full["history"][2]["error"]["type"] == "ValueError"

        done = (await admin.get(f"/v1/admin/jobs/{big['id']}")).json()
        assert done["job"]["state"] == "succeeded"
        assert done["payload"] == {"size": 70_002, "value": None, "truncated": True}
        assert done["result"]["truncated"] is True  # echo returns its payload
        whole = await admin.get(f"/v1/admin/jobs/{big['id']}/payload")
        assert whole.status_code == 200 and whole.json() == "y" * 70_000
        assert (await admin.get(f"/v1/admin/jobs/{big['id']}/result")).json() == "y" * 70_000
        assert (await admin.get(f"/v1/admin/jobs/{job['id']}/result")).json() is None

        # gone from Redis (retention): Postgres has all of it
        await queue.redis.delete(queue.keys.job(job["id"]), queue.keys.job(big["id"]))
        late = (await admin.get(f"/v1/admin/jobs/{job['id']}")).json()
        assert late["source"] == "postgres" and late["job"] == full["job"]
        assert late["payload"]["value"] == {"x": [1, 2]} and late["history"] == full["history"]
        late_big = (await admin.get(f"/v1/admin/jobs/{big['id']}")).json()
        assert late_big["payload"]["truncated"] and late_big["result"]["truncated"]
        assert (await admin.get(f"/v1/admin/jobs/{big['id']}/payload")).json() == "y" * 70_000
        unknown = queue.keys.new_id()
        for path in ("", "/payload", "/result"):
            r = await admin.get(f"/v1/admin/jobs/{unknown}{path}")
            assert r.status_code == 404 and r.json()["type"] == "urn:jobtier:problem:not-found"
        assert (await acme.get(f"/v1/admin/jobs/{job['id']}")).status_code == 403


async def test_a_job_shows_its_log_lines_and_the_traceback_its_worker_recorded(
    pg_api: ApiServer, queue: Queue, persister: Persister
) -> None:
    """What a real worker records: the lines the task logged (ctx.log) and the bounded
    traceback of what it raised, chained cause included (the error's ``traceback``)."""
    chatty = await queue.submit("chatty", {"n": 2}, tenant="acme")
    deep = await queue.submit("deep_failure", None, tenant="acme", max_attempts=1)
    await worker_for(queue, debug_tasks.registry, burst=True).run()
    async with pg_api.client("admin") as admin:
        talked = (await admin.get(f"/v1/admin/jobs/{chatty.job_id}")).json()
        assert talked["job"]["state"] == "succeeded"
        assert [(line["attempt"], line["message"]) for line in talked["lines"]] == [
            (1, "line 0"), (1, "line 1"), (1, "done"),
        ]  # fmt: skip
        assert all(datetime.fromisoformat(line["at"]).tzinfo for line in talked["lines"])

        failed = (await admin.get(f"/v1/admin/jobs/{deep.job_id}")).json()
        error = failed["job"]["error"]
        assert failed["job"]["state"] == "failed" and error["type"] == "ValueError"
        assert isinstance(error["traceback"], str)
        assert "KeyError: 'missing'" in error["traceback"]  # the cause
        assert error["traceback"].rstrip().splitlines()[-1].startswith("ValueError: the record")
        assert failed["lines"] == []

        await persister.drain()
        full = (await admin.get(f"/v1/admin/jobs/{deep.job_id}")).json()
        (ended,) = [t for t in full["history"] if t["from_state"] == "running"]
        assert ended["to_state"] == "failed" and ended["error"] == error  # the same, every member

        # Redis forgets the job and its lines (retention): Postgres keeps the rest
        await queue.redis.delete(queue.keys.job(chatty.job_id), queue.keys.lines(chatty.job_id))
        late = (await admin.get(f"/v1/admin/jobs/{chatty.job_id}")).json()
        assert late["source"] == "postgres" and late["lines"] == []


async def test_a_large_result_is_named_and_streamed_never_inlined(
    start_api: StartApi, pg_settings: Settings, pg_pool: Pool
) -> None:
    s = pg_settings.replace(result_store="postgres", result_store_threshold_bytes=1000)
    api = await start_api(
        PostgresExtension(s), database_url=s.database_url, result_store=s.result_store,
        result_store_threshold_bytes=s.result_store_threshold_bytes,
    )  # fmt: skip
    expected = encode_json(big_rows(3000))
    q = await Queue.connect(s, catalog=False)
    try:
        big = await q.submit("big_result", 3000, tenant="acme")
        await worker_for(q, registry, burst=True).run()
        async with api.client("admin") as admin:
            detail = (await admin.get(f"/v1/admin/jobs/{big.job_id}")).json()
            assert detail["source"] == "redis" and detail["job"]["state"] == "succeeded"
            ref = detail["result"]["ref"]
            assert ref.startswith(f"pg:{big.job_id}:")
            assert detail["result"] == {
                "size": len(expected), "value": None, "truncated": False, "ref": ref,
            }  # fmt: skip
            assert detail["job"]["result_url"] == f"/v1/jobs/{big.job_id}/result/content"
            whole = await admin.get(f"/v1/admin/jobs/{big.job_id}/result")
            assert whole.status_code == 200 and whole.content == expected  # byte for byte

            await Persister(s, q.redis, pg_pool, "console-persister").drain()
            await q.redis.delete(q.keys.job(big.job_id))  # retention: Postgres names it too
            late = (await admin.get(f"/v1/admin/jobs/{big.job_id}")).json()
            assert late["source"] == "postgres" and late["result"] == detail["result"]
            assert (await admin.get(f"/v1/admin/jobs/{big.job_id}/result")).content == expected

            # the store no longer has it: said so, not a broken value
            await pg_pool.execute("DELETE FROM result_blobs WHERE job_id = $1", big.job_id)
            gone = (await admin.get(f"/v1/admin/jobs/{big.job_id}")).json()
            assert gone["result"] == {"size": None, "value": None, "truncated": False, "ref": ref}
            r = await admin.get(f"/v1/admin/jobs/{big.job_id}/result")
            assert r.status_code == 410 and r.json()["type"] == "urn:jobtier:problem:gone"
    finally:
        await q.close()


async def test_actions_are_audited_with_who_what_and_the_answer(
    pg_api: ApiServer, queue: Queue, persister: Persister
) -> None:
    me = fingerprint(ADMIN)
    async with pg_api.client() as acme, pg_api.client("admin") as admin:
        waiting = (await acme.post("/v1/jobs", json={"type": "echo", "queue": "bulk"})).json()
        for _ in range(4):
            await acme.post("/v1/jobs", json={"type": "echo", "queue": "bulk"})
        dead = (await acme.post("/v1/jobs", json={"type": "echo", "queue": "tb"})).json()
        await fail_with_traceback(queue, dead["id"])

        r = await admin.post(f"/v1/admin/jobs/{waiting['id']}/cancel")
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        again = await admin.post(f"/v1/admin/jobs/{waiting['id']}/cancel")
        assert again.status_code == 409 and again.json()["job"]["state"] == "cancelled"
        nobody = queue.keys.new_id()
        assert (await admin.post(f"/v1/admin/jobs/{nobody}/cancel")).status_code == 404
        assert (await admin.post("/v1/admin/queues/bulk/pause")).status_code == 200
        purged = await admin.post("/v1/admin/queues/bulk/purge")
        assert purged.json() == {"queue": "bulk", "cancelled": 4, "remaining": 0}
        assert (await admin.post("/v1/admin/queues/bulk/resume")).status_code == 200
        r = await admin.post(
            "/v1/admin/dead-letters/replay", json={"queue": "tb", "tenant": "acme"}
        )
        assert r.json() == {"replayed": [dead["id"]], "count": 1, "skipped": []}
        # refused before anything ran: not an action, not audited
        assert (await admin.post("/v1/admin/queues/a%20b/purge")).status_code == 422
        assert (await acme.post("/v1/admin/queues/bulk/purge")).status_code == 403

        page = (await admin.get("/v1/admin/audit")).json()
        assert page["you"] == me and page["next_cursor"] is None
        got = [(x["action"], x["target"], x["status"]) for x in page["records"]]
        assert got == [
            ("dead_letters.replay", "queue=tb,tenant=acme", 200),
            ("queue.resume", "bulk", 200),
            ("queue.purge", "bulk", 200),
            ("queue.pause", "bulk", 200),
            ("job.cancel", nobody, 404),
            ("job.cancel", waiting["id"], 409),
            ("job.cancel", waiting["id"], 200),
        ]
        assert {x["actor"] for x in page["records"]} == {me}
        assert ADMIN not in json.dumps(page)  # the key itself is never stored
        purge = page["records"][2]
        assert (
            purge["detail"] == {"cancelled": 4, "remaining": 0} and purge["source"] == "127.0.0.1"
        )
        assert page["records"][0]["detail"]["replayed"] == [dead["id"]]
        # by target, and in the job's own page
        mine = (await admin.get(f"/v1/admin/audit?target={waiting['id']}")).json()["records"]
        assert [x["status"] for x in mine] == [409, 200]
        await persister.drain()
        detail = (await admin.get(f"/v1/admin/jobs/{waiting['id']}")).json()
        assert [x["status"] for x in detail["audit"]] == [409, 200]
        # paging
        first = (await admin.get("/v1/admin/audit?limit=3")).json()
        rest = (await admin.get(f"/v1/admin/audit?limit=10&cursor={first['next_cursor']}")).json()
        assert [x["id"] for x in first["records"] + rest["records"]] == [
            x["id"] for x in page["records"]
        ]
        assert (await admin.get("/v1/admin/audit?action=queue.purge")).json()["records"] == [purge]
    # every action is in the log too: asserted on the Postgres rows above, the log line is
    # written before them (api/audit.py)


async def test_an_action_while_postgres_is_down_is_done_and_audited_when_it_is_back(
    start_api: StartApi, pg_settings: Settings, queue: Queue, pg_to_stop: LocalPostgres
) -> None:
    """A live Postgres stopped under a running API (``-m immediate``: a crash): an admin
    action is done meanwhile (it needs Redis only), its audit record waits in Redis and the
    audit read is a 503 with Retry-After; once Postgres is back the same API writes the
    record by itself at the next read, once."""
    settings = pg_settings.replace(database_url=pg_to_stop.dsn)
    api = await start_api(PostgresExtension(settings), database_url=settings.database_url)
    async with api.client("admin") as admin:
        assert (await admin.post("/v1/admin/queues/emails/resume")).status_code == 200
        first = (await admin.get("/v1/admin/audit")).json()["records"]
        assert [(x["action"], x["target"]) for x in first] == [("queue.resume", "emails")]

        await asyncio.to_thread(pg_to_stop.stop, "immediate")
        assert (await admin.post("/v1/admin/queues/emails/pause")).status_code == 200
        assert (await queue.admin.stats())["queues"]["emails"]["paused"] is True
        r = await admin.get("/v1/admin/audit")
        assert r.status_code == 503 and r.headers["retry-after"]
        pending = await queue.redis.lrange(queue.keys.audit_pending(), 0, -1)
        assert len(pending) == 1 and b'"queue.pause"' in pending[0]

        await asyncio.to_thread(pg_to_stop.start)

        async def audit_answers() -> bool:
            return (await admin.get("/v1/admin/audit")).status_code == 200

        await wait_for(audit_answers, timeout=30)
        records = (await admin.get("/v1/admin/audit")).json()["records"]
        assert [(x["action"], x["target"]) for x in records] == [
            ("queue.pause", "emails"),
            ("queue.resume", "emails"),
        ]
        assert (await admin.get("/v1/admin/audit")).json()["records"] == records  # written once
    assert await queue.redis.llen(queue.keys.audit_pending()) == 0


async def test_workers_and_the_jobs_they_run(
    pg_api: ApiServer, queue: Queue, background: Background
) -> None:
    async with pg_api.client() as acme, pg_api.client("admin") as admin:
        assert (await admin.get("/v1/admin/workers")).json() == {
            "workers": [], "running_total": 0, "running_listed": 0,
        }  # fmt: skip
        job = (
            await acme.post("/v1/jobs", json={"type": "sleep", "payload": {"seconds": 60}})
        ).json()
        worker = worker_for(queue, registry, concurrency=3, name="w-console")
        background.start(worker)

        async def shown() -> Any:
            body = (await admin.get("/v1/admin/workers")).json()
            return body if body["workers"] and body["workers"][0]["jobs"] else None

        await wait_for(shown, timeout=20)
        body = await shown()
        (w,) = body["workers"]
        assert w["id"] == "w-console" and w["concurrency"] == 3 and w["pid"] > 0
        assert w["host"] and "default" in w["queues"] and "sleep" in w["tasks"]
        assert [(j["id"], j["tenant"], j["type"], j["attempt"]) for j in w["jobs"]] == [
            (job["id"], "acme", "sleep", 1)
        ]
        assert body["running_total"] == body["running_listed"] == 1
        await admin.post(f"/v1/admin/jobs/{job['id']}/cancel")  # the worker stops it


async def read_events(lines: AsyncIterator[str], n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async for line in lines:
        if line.startswith("data:"):
            out.append(json.loads(line[5:]))
            if len(out) == n:
                return out
    raise AssertionError("the stream ended")


async def test_the_followed_jobs_stream_sends_their_status_then_each_change(
    pg_api: ApiServer, queue: Queue
) -> None:
    async with (
        pg_api.client() as acme,
        pg_api.client("globex") as globex,
        pg_api.client("admin") as admin,
    ):
        a = (await acme.post("/v1/jobs", json={"type": "echo"})).json()
        g = (await globex.post("/v1/jobs", json={"type": "echo"})).json()
        unknown = queue.keys.new_id()
        url = f"/v1/admin/events?ids={a['id']},{g['id']},{unknown}"
        async with admin.stream("GET", url) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
            lines = r.aiter_lines()
            first = await read_events(lines, 2)
            assert {(e["id"], e["state"]) for e in first} == {
                (a["id"], "queued"),
                (g["id"], "queued"),
            }
            await globex.post(f"/v1/jobs/{g['id']}/cancel")
            (change,) = await read_events(lines, 1)
            assert (change["id"], change["state"], change["version"]) == (g["id"], "cancelled", 2)
        for bad in ("", "ids=", "ids=nope", f"ids={a['id']},", "ids=" + ",".join([a["id"]] * 101)):
            r = await admin.get(f"/v1/admin/events?{bad}")
            assert r.status_code == 400, bad
        assert (await admin.get(f"/v1/admin/events?ids={unknown}")).status_code == 404
        async with acme.stream("GET", f"/v1/admin/events?ids={a['id']}") as r:
            assert r.status_code == 403


async def first_frame(api: ApiServer) -> dict[str, Any]:
    """The first frame of the console's stream (a frame a second, each made at most once a
    second per process)."""
    async with (
        api.client("admin") as admin,
        admin.stream("GET", "/v1/admin/dashboard/stream") as stream,
    ):
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                frame: dict[str, Any] = json.loads(line[6:])
                return frame
    raise AssertionError("the stream ended without a frame")


async def test_the_oldest_wait_is_unknown_when_nothing_waits(api: ApiServer) -> None:
    """The console's "oldest waiting" tile showed 0 ms on an empty deployment (the queue
    table, "—"): with no ready job there is no oldest wait, and the frame says so."""
    assert (await first_frame(api))["oldest_queued_age_seconds"] is None
    async with api.client() as c:
        assert (await c.post("/v1/jobs", json={"type": "echo"})).status_code == 202

    async def waiting() -> bool:  # the next frame (the last is cached for up to a second)
        age = (await first_frame(api))["oldest_queued_age_seconds"]
        return age is not None and age >= 0

    await wait_for(waiting)
