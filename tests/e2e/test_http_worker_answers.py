"""What an HTTP worker is told (api/worker_routes.py), black-box against a real API and
Redis: a busy worker stays live by its heartbeats, a refused answer says what the job is now
(so that an answer sent again, its first reply lost, can be told from a lost lease), a long
failure message is kept cut rather than refused, and an advert says what is wrong with it."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from jobtier.api.worker_claims import WorkerClaims
from jobtier.core.model import Backoff, TaskAd
from jobtier.engine.catalog import publish
from tests.e2e.test_http_worker import claim_one, lease, serve, status, submit, worker_client
from tests.fixtures.api import StartApi
from tests.fixtures.engine import wait_for

HANG_GUARD = 30.0  # s: only stops a broken test from hanging

pytestmark = pytest.mark.contract


async def listed(admin: object, worker: str) -> bool:
    workers = (await admin.get("/v1/admin/workers")).json()["workers"]  # type: ignore[attr-defined]
    return any(w["id"] == worker for w in workers)


async def test_a_worker_busy_with_its_jobs_stays_live_by_their_heartbeats(
    start_api: StartApi,
) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    queue = api.server.lifespan.state["queue"]
    claims: WorkerClaims = api.server.lifespan.state["worker_claims"]
    async with worker_client(api) as w, api.client("admin") as admin:
        job = await claim_one(w)  # its one slot busy from now on: it claims no more
        assert await listed(admin, "http:w1")
        # a minute on, as the advert its claim wrote has aged (and this API's memory of it)
        key, raw = queue.keys.workers(), await queue.redis.hget(queue.keys.workers(), "http:w1")
        info = msgspec.json.decode(raw)
        info["seen_at"] = time.time() - 120
        await queue.redis.hset(key, "http:w1", msgspec.json.encode(info))
        claims.advertised["http:w1"] = 0.0
        assert not await listed(admin, "http:w1")
        r = await w.post(f"/v1/worker/jobs/{job_id}/heartbeat", json=lease(job))
        assert r.status_code == 200, r.text
        assert await listed(admin, "http:w1")  # live again, as it is
        (mine,) = [x for x in (await admin.get("/v1/admin/workers")).json()["workers"]
                   if x["id"] == "http:w1"]  # fmt: skip
        assert mine["tasks"] == ["http.add"]  # what its claim said it serves, kept


async def test_a_refused_answer_says_what_the_job_is_now(start_api: StartApi) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    base = f"/v1/worker/jobs/{job_id}"
    async with worker_client(api) as w:
        job = await claim_one(w)
        # a lease_version never given is not said to be a newer claim's
        made_up = lease(job) | {"lease_version": job["lease_version"] + 7}
        r = await w.post(f"{base}/heartbeat", json=made_up)
        assert r.status_code == 409, r.text
        assert "or this lease_version was never given" in r.json()["detail"], r.text
        assert (r.json()["state"], r.json()["worker"]) == ("running", "http:w1"), r.text
        r = await w.post(f"{base}/complete", json=lease(job, result=3))
        assert r.status_code == 200, r.text
        # the same answer again, as a worker whose first reply was lost sends it
        again = await w.post(f"{base}/complete", json=lease(job, result=3))
        assert again.status_code == 409, again.text
        problem = again.json()
        assert (problem["state"], problem["attempt"], problem["worker"]) == (
            "succeeded", 1, "http:w1",
        )  # fmt: skip
        assert "it is succeeded now (attempt 1, worker http:w1)" in problem["detail"]
    assert (await status(api, job_id))["state"] == "succeeded"


async def test_a_long_failure_message_is_kept_cut_not_refused(start_api: StartApi) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    async with worker_client(api) as w:
        job = await claim_one(w)
        error = {"type": "Boom", "message": "m" * 10_000}
        body = lease(job, error=error, retryable=False)
        r = await w.post(f"/v1/worker/jobs/{job_id}/fail", json=body)
        assert r.status_code == 200, r.text
    message = (await status(api, job_id))["error"]["message"]
    assert len(message) == 4000 and message.endswith("…") and message.startswith("mmm")


@pytest.mark.parametrize(
    ("tasks", "field", "says"),
    [
        ([{"type": "t.a"}, {"type": "t.b"}, {"type": "t.a", "queue": "q2"}], "tasks[2].type",
         "'t.a' is advertised twice (tasks[0] too)"),
        ([{"type": "t.a", "payload_schema": {"type": "nonsense"}}], "tasks[0].payload_schema",
         "is refused, not a JSON Schema: 'nonsense' is not valid"),
        # the API applies the schema to every tenant's submits: it reads no file, fetches no
        # URL, follows only references to its own $defs (without circles or a blow-up), has
        # nothing that switches jsonschema to a validator of its own, and matches no pattern
        # in more than linear time
        ([{"type": "t.a", "payload_schema": {"$ref": "file:///etc/hostname"}}],
         "tasks[0].payload_schema", "'file:///etc/hostname' is not '#/$defs/<name>'"),
        ([{"type": "t.a", "payload_schema": {"properties": {"x": {"$ref": "http://127.0.0.1:9/s"}}}}],
         "tasks[0].payload_schema", "only those are followed (at /properties/x)"),
        ([{"type": "t.a", "payload_schema": {"$ref": "#/$defs/nope"}}], "tasks[0].payload_schema",
         "'#/$defs/nope' points at nothing in the schema"),
        ([{"type": "t.a", "payload_schema": {"type": "string", "pattern": "^(?=a)b"}}],
         "tasks[0].payload_schema", "is not one RE2 matches (in linear time)"),
        ([{"type": "t.a", "payload_schema": {"patternProperties": {"^(a+)+$": {}}}}],
         "tasks[0].payload_schema", "patternProperties (use propertyNames with a pattern) is not"),
        # a nested $schema made jsonschema validate that part with its stock class, whose
        # patterns are Python's (backtracking) again
        ([{"type": "t.a", "payload_schema": {"properties": {"a": {
            "$schema": "https://json-schema.org/draft/2020-12/schema", "pattern": "^(a+)+$"}}}}],
         "tasks[0].payload_schema", "a $schema inside the schema is not supported here"),
        ([{"type": "t.a", "payload_schema": {"properties": {"x": {"$ref": "#"}}}}],
         "tasks[0].payload_schema", "'#' is not '#/$defs/<name>'"),
        # into a value keyword, which the checks do not read as a schema
        ([{"type": "t.a", "payload_schema": {"$ref": "#/default", "default": {
            "patternProperties": {"^(a+)+$": {}}}}}],
         "tasks[0].payload_schema", "'#/default' is not '#/$defs/<name>'"),
        ([{"type": "t.a", "payload_schema": {"$defs": {"a": {"$ref": "#/$defs/b"},
            "b": {"items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"}}],
         "tasks[0].payload_schema", "refers to itself (through $ref)"),
        ([{"type": "t.a", "payload_schema": {"$defs": {"a0": {"type": "integer"}, **{
            f"a{i}": {"allOf": [{"$ref": f"#/$defs/a{i - 1}"}, {"$ref": f"#/$defs/a{i - 1}"}]}
            for i in range(1, 20)}}, "$ref": "#/$defs/a19"}}],
         "tasks[0].payload_schema", "once its $refs are followed"),
        ([{"type": "t.a", "payload_schema": {"type": "array", "uniqueItems": True}}],
         "tasks[0].payload_schema", "uniqueItems (it compares every pair of items) is not"),
        ([{"type": "t.a", "payload_schema": {"properties": {"x": {"$id": "http://x/y"}}}}],
         "tasks[0].payload_schema", "a $id is not supported here (at /properties/x)"),
    ],
)  # fmt: skip
async def test_an_advert_says_what_is_wrong_with_it(
    start_api: StartApi, tasks: list[dict[str, object]], field: str, says: str
) -> None:
    api = await serve(start_api)
    async with worker_client(api) as w:
        r = await w.put("/v1/worker/tasks", json={"worker": "w2", "tasks": tasks})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field and says in r.json()["detail"], r.text
    async with api.client("admin") as admin:
        known = {t["type"] for t in (await admin.get("/v1/admin/tasks")).json()["tasks"]}
    assert "t.a" not in known  # nothing advertised


async def test_a_limited_queue_is_named_to_http_workers_and_in_explain(
    start_api: StartApi, caplog: pytest.LogCaptureFixture
) -> None:
    """A queue with a concurrency or rate limit gives an HTTP worker none of its jobs (only
    Python workers take its permits): a claim naming only limited queues is a 409 at once,
    not a wait for jobs it can never have; a claim naming others too gets theirs, and the
    limited ones named; explain says that no worker that can take the job serves its queue.
    Before, the claim waited out its `wait` and answered nothing, and explain said nothing
    held the job back."""
    api = await serve(start_api)
    async with api.client("admin") as admin:
        r = await admin.put("/v1/admin/queues/lim/limits", json={"concurrency": 2})
        assert r.status_code == 200, r.text
    async with api.client() as c:
        job = {"type": "http.add", "queue": "lim", "payload": {"a": 1, "b": 2}}
        r = await c.post("/v1/jobs", json=job)
        assert r.status_code == 202, r.text
        held = r.json()["id"]
    free = await submit(api, {"a": 3, "b": 4})  # the default queue: no limit
    async with worker_client(api) as w:
        body = {"worker": "w1", "types": ["http.add"], "queues": ["lim"], "wait": 60}
        async with asyncio.timeout(HANG_GUARD):  # under the claim's wait
            r = await w.post("/v1/worker/claim", json=body)
        assert r.status_code == 409, r.text
        problem = r.json()
        assert problem["type"].endswith("queue-limited") and problem["queues"] == ["lim"]
        assert "only Python workers" in problem["detail"]
        body["queues"] = ["default", "lim"]
        r = await w.post("/v1/worker/claim", json=body)
        assert r.status_code == 200, r.text
        assert [j["id"] for j in r.json()["jobs"]] == [free] and r.json()["limited"] == ["lim"]
    assert "event=http_claim_limited_queue worker=http:w1 queue=lim" in caplog.text
    async with api.client() as c:
        reasons = (await c.get(f"/v1/jobs/{held}/explain")).json()["reasons"]
    assert [r["code"] for r in reasons if r["code"] == "no_worker_for_queue"], reasons
    assert any("only Python workers take its permits" in r["message"] for r in reasons), reasons


async def test_a_waiting_claim_names_the_queues_limited_when_it_answers(
    start_api: StartApi,
) -> None:
    """The limited queues a claim names are those its last look found limited: a limit
    lifted while the claim waits no longer counts (its answer carried the queue as limited
    along with that queue's job, before)."""
    api = await serve(start_api)
    claims: WorkerClaims = api.server.lifespan.state["worker_claims"]
    async with api.client("admin") as admin:
        assert (await admin.put("/v1/admin/queues/lim/limits", json={"concurrency": 2})).is_success
        async with api.client() as c:
            job = {"type": "http.add", "queue": "lim", "payload": {"a": 1, "b": 2}}
            held = (await c.post("/v1/jobs", json=job)).json()["id"]
        async with worker_client(api) as w:
            body = {"worker": "w1", "types": ["http.add"], "queues": ["default", "lim"], "wait": 20}
            waiting = asyncio.create_task(w.post("/v1/worker/claim", json=body))
            try:
                await wait_for(lambda: claims.waiting() == 1)  # nothing it may take yet
                assert (await admin.put("/v1/admin/queues/lim/limits", json={})).is_success
                async with asyncio.timeout(HANG_GUARD):  # its next look (IDLE_LOOK) finds it
                    r = await waiting
            finally:
                waiting.cancel()
    assert r.status_code == 200, r.text
    assert [j["id"] for j in r.json()["jobs"]] == [held] and r.json()["limited"] == [], r.text


async def test_an_advertised_schema_reads_nothing_and_matches_in_linear_time(
    start_api: StartApi,
) -> None:
    """A schema an HTTP worker advertises checks every tenant's submits of its task: its local
    references are followed, its patterns matched by RE2. A pattern that backtracks for ever
    in Python's `re` (`^(a+)+$` against a long run of a's and a '!') answers at once; before,
    a 26-character payload held the API's only thread for about 1.5 s, and each more doubled
    it."""
    api = await serve(start_api)
    schema = {
        "$defs": {"word": {"type": "string", "pattern": "^(a+)+$"}},
        "type": "object",
        "properties": {"w": {"$ref": "#/$defs/word"}},
        "required": ["w"],
    }
    async with worker_client(api) as w:
        task = {"type": "t.re", "queue": "default", "payload_schema": schema}
        r = await w.put("/v1/worker/tasks", json={"worker": "w3", "tasks": [task]})
    assert r.status_code == 200, r.text
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "t.re", "payload": {"w": "a" * 200 + "!"}})
        assert r.status_code == 422 and r.json()["field"] == "payload.w", r.text
        assert "does not match" in r.json()["detail"]
        r = await c.post("/v1/jobs", json={"type": "t.re", "payload": {"w": "aaaa"}})
        assert r.status_code == 202, r.text


async def test_a_payload_its_schema_cannot_judge_is_a_422(start_api: StartApi) -> None:
    """A number too large for a multipleOf (an OverflowError in jsonschema): the submit is
    refused, saying so, rather than a 500."""
    api = await serve(start_api)
    schema = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.01}}}
    async with worker_client(api) as w:
        task = {"type": "t.big", "queue": "default", "payload_schema": schema}
        r = await w.put("/v1/worker/tasks", json={"worker": "w4", "tasks": [task]})
        assert r.status_code == 200, r.text
    async with api.client() as c:
        body = b'{"type": "t.big", "payload": {"n": 1' + b"0" * 400 + b"}}"
        r = await c.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["field"] == "payload", r.text
        assert "its task's schema cannot judge it (OverflowError)" in r.json()["detail"]


async def test_a_python_workers_schema_keeps_its_own_patterns(start_api: StartApi) -> None:
    """The subset HTTP workers are held to is not a Python worker's (its schema is its task's
    own type, deployed by whoever reaches Redis): its patterns stay Python's, as the worker's
    own check reads them (\\w takes 'José'; a look-ahead is still applied, not dropped)."""
    api = await serve(start_api)
    state = api.server.lifespan.state
    queue = state["queue"]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": r"^(?!admin)\w+$"}},
        "required": ["name"],
    }
    ad = TaskAd(
        type="t.py", queue="default", max_attempts=3, backoff=Backoff(1, 2, 60, 0.1),
        timeout=None, payload_schema=schema, seen_at=time.time(), worker="host:1:py",
    )  # fmt: skip
    await publish(queue.redis, queue.keys, [ad])
    await state["catalog"].load()
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "t.py", "payload": {"name": "José"}})
        assert r.status_code == 202, r.text
        r = await c.post("/v1/jobs", json={"type": "t.py", "payload": {"name": "admin"}})
        assert r.status_code == 422 and r.json()["field"] == "payload.name", r.text
