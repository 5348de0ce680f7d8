"""The answers about real jobs and schedules match the OpenAPI document.

The fuzzer (test_api_fuzz.py) mostly meets ids nobody has; here every route is driven
through the states that give its other answers — a duplicate submit, 304, a cancel that is
too late, a finished stream, a dead letter replayed, a schedule's whole life — and each
answer is checked against ``/v1/openapi.json`` by schemathesis (status documented for the
operation, content type, body schema, headers).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.core.names import QUEUE_NAME_RE
from jobtier.engine.queue import Queue
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import worker_for
from tests.tasks import registry


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(
        PostgresExtension(pg_settings),
        database_url=pg_settings.database_url,
        webhook_allowed_hosts="127.0.0.1",
    )


class Checked:
    """Sends requests and checks each answer against the document's operation."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.schema = schemathesis.openapi.from_dict(document)
        self.seen: set[tuple[str, str, int]] = set()

    def documented(self, method: str, template: str, r: httpx.Response) -> None:
        """The status is one the operation gives, with its media type (schemathesis's
        ``validate_response`` checks the body only)."""
        what = f"{method} {template}: {r.status_code}"
        answer = self.document["paths"][template][method.lower()]["responses"].get(
            str(r.status_code)
        )
        assert answer is not None, f"{what} is not documented"
        media = r.headers.get("content-type", "").split(";")[0]
        assert media in answer.get("content", {"": None}), f"{what} answers {media!r}"

    async def __call__(
        self, client: httpx.AsyncClient, method: str, template: str, status: int, **kw: Any
    ) -> httpx.Response:
        path = template.format(**kw.pop("ids", {}))
        if template.endswith("/events"):  # the stream's status only (the fuzzer reads events)
            async with client.stream(method, path, **kw) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # the first event is enough; the stream goes on
                await r.aclose()
            assert r.status_code == status, f"{method} {template}: {r.status_code}"
            self.documented(method, template, r)
            self.seen.add((method, template, status))
            return r
        r = await client.request(method, path, **kw)
        assert r.status_code == status, f"{method} {template}: {r.status_code} {r.text[:300]}"
        self.documented(method, template, r)
        self.schema[template][method].validate_response(r)
        self.seen.add((method, template, status))
        return r


async def test_answers_about_real_jobs_and_schedules_match_the_document(
    pg_api: ApiServer, queue: Queue
) -> None:
    async with pg_api.client(None) as anonymous:
        check = Checked((await anonymous.get("/v1/openapi.json")).json())
    async with pg_api.client() as c, pg_api.client("admin") as admin:
        keyed = {"type": "echo", "payload": 1, "idempotency_key": "conf-1"}
        job = (await check(c, "POST", "/v1/jobs", 202, json=keyed)).json()
        ids = {"job_id": job["id"]}
        await check(c, "POST", "/v1/jobs", 200, json=keyed)
        await check(c, "POST", "/v1/jobs", 409, json={**keyed, "payload": 2})
        batch = {"jobs": [{"type": "echo"}, {**keyed, "payload": 3}]}
        items = (await check(c, "POST", "/v1/jobs/batch", 200, json=batch)).json()["results"]
        assert [i["status"] for i in items] == [202, 409]
        await check(c, "GET", "/v1/jobs/{job_id}", 200, ids=ids)
        etag = {"if-none-match": f'"{job["version"]}"'}
        await check(c, "GET", "/v1/jobs/{job_id}", 304, ids=ids, headers=etag)
        await check(c, "GET", "/v1/jobs/{job_id}/result", 200, ids=ids)
        await check(c, "GET", "/v1/jobs/{job_id}/history", 200, ids=ids)
        await check(c, "GET", "/v1/jobs/{job_id}/logs", 200, ids=ids)
        await check(c, "GET", "/v1/jobs/{job_id}/checkpoint", 200, ids=ids)
        await check(c, "GET", "/v1/jobs/{job_id}/explain", 200, ids=ids)
        await check(admin, "GET", "/v1/admin/jobs/{job_id}/explain", 200, ids=ids)
        await check(c, "GET", "/v1/jobs/{job_id}/explain", 404, ids={"job_id": "x"})
        await check(c, "POST", "/v1/jobs/{job_id}/retry", 409, ids=ids)
        await check(c, "GET", "/v1/jobs/{job_id}/events", 200, ids=ids)
        await check(c, "GET", "/v1/jobs", 200, params={"limit": 5})
        waiting = (await check(c, "POST", "/v1/jobs", 202, json={"type": "echo"})).json()
        await check(c, "POST", "/v1/jobs/{job_id}/cancel", 200, ids={"job_id": waiting["id"]})
        later = {"type": "echo", "delay": 3600}
        delayed = {"job_id": (await check(c, "POST", "/v1/jobs", 202, json=later)).json()["id"]}
        await check(c, "POST", "/v1/jobs/{job_id}/promote", 200, ids=delayed)
        await check(c, "POST", "/v1/jobs/{job_id}/promote", 409, ids=delayed)
        await check(c, "POST", "/v1/jobs/{job_id}/promote", 404, ids={"job_id": "x"})
        high = {"priority": "high"}
        await check(c, "POST", "/v1/jobs/{job_id}/priority", 200, ids=delayed, json=high)
        bad = {"priority": "urgent"}
        await check(c, "POST", "/v1/jobs/{job_id}/priority", 422, ids=delayed, json=bad)
        await check(c, "POST", "/v1/jobs/{job_id}/priority", 404, ids={"job_id": "x"}, json=high)
        await check(c, "POST", "/v1/jobs/{job_id}/cancel", 200, ids=delayed)
        await check(c, "POST", "/v1/jobs/{job_id}/priority", 409, ids=delayed, json=high)

        # flows: created, repeated, refused; a dependent's document and its dependencies
        flow = {
            "jobs": [
                {"type": "echo", "payload": 1, "ref": "a"},
                {"type": "echo", "payload": 2, "after": ["a"], "depends_on": [job["id"]]},
            ],
            "idempotency_key": "conf-flow",
        }
        made = (await check(c, "POST", "/v1/flows", 202, json=flow)).json()
        await check(c, "POST", "/v1/flows", 200, json=flow)
        await check(c, "POST", "/v1/flows", 409, json={**flow, "jobs": flow["jobs"][:1]})
        cycle = {"jobs": [{"type": "echo", "ref": "a", "after": ["a"]}]}
        await check(c, "POST", "/v1/flows", 422, json=cycle)
        dependent = {"job_id": made["jobs"][1]["id"]}
        assert made["jobs"][1]["state"] == "waiting"
        await check(c, "GET", "/v1/jobs/{job_id}", 200, ids=dependent)
        await check(c, "GET", "/v1/jobs/{job_id}/dependencies", 200, ids=dependent)
        # the console's detail of it: its dependencies and children, as documented
        shown = (await check(admin, "GET", "/v1/admin/jobs/{job_id}", 200, ids=dependent)).json()
        assert [d["child"] for d in shown["dependencies"]] == [True, False]
        await check(
            c, "GET", "/v1/jobs/{job_id}/dependencies", 404, ids={"job_id": queue.keys.new_id()}
        )
        await check(
            c, "POST", "/v1/jobs", 422, json={"type": "echo", "depends_on": [queue.keys.new_id()]}
        )

        failing = (
            await c.post("/v1/jobs", json={"type": "fail", "payload": {"fatal": True}})
        ).json()
        await worker_for(queue, registry, burst=True).run()
        done = (await check(c, "GET", "/v1/jobs/{job_id}", 200, ids=ids)).json()
        assert done["state"] == "succeeded"
        await check(c, "POST", "/v1/jobs/{job_id}/cancel", 409, ids=ids)
        finished = {"last-event-id": str(done["version"])}
        await check(c, "GET", "/v1/jobs/{job_id}/events", 204, ids=ids, headers=finished)
        await check(c, "GET", "/v1/jobs/{job_id}/result", 200, ids=ids)

        await check(c, "GET", "/v1/jobs/{job_id}/result/content", 200, ids=ids)
        cancelled = {"job_id": waiting["id"]}
        await check(c, "GET", "/v1/jobs/{job_id}/result/content", 409, ids=cancelled)
        await check(c, "GET", "/v1/jobs/{job_id}/deliveries", 200, ids=ids)
        await check(c, "POST", "/v1/webhook-secret", 201)
        hook = {"url": "http://127.0.0.1:9/hook", "events": "all"}  # no dispatcher: not sent
        made = (await check(c, "POST", "/v1/webhooks", 201, json=hook)).json()
        wid = {"webhook_id": made["id"]}
        metadata = {"url": "http://169.254.169.254/latest/meta-data"}  # refused, not contacted
        await check(c, "POST", "/v1/webhooks", 422, json=metadata)
        await check(c, "GET", "/v1/webhooks", 200)
        await check(c, "GET", "/v1/webhooks/{webhook_id}", 200, ids=wid)
        await check(c, "GET", "/v1/webhooks/{webhook_id}/deliveries", 200, ids=wid)
        await check(c, "DELETE", "/v1/webhooks/{webhook_id}", 204, ids=wid)
        await check(c, "GET", "/v1/webhooks/{webhook_id}", 404, ids=wid)
        dead = {"job_id": failing["id"]}
        await check(admin, "GET", "/v1/admin/dead-letters", 200)
        await check(
            admin, "GET", "/v1/admin/dead-letters", 200, params={"since": "2024-01-01T00:00:00Z"}
        )
        await check(admin, "GET", "/v1/admin/dead-letters/{job_id}", 200, ids=dead)
        await check(admin, "GET", "/v1/admin/dead-letters/{job_id}", 404, ids=ids)
        await check(admin, "POST", "/v1/admin/dead-letters/{job_id}/replay", 409, ids=ids)
        await check(admin, "POST", "/v1/admin/dead-letters/{job_id}/replay", 200, ids=dead)
        await worker_for(queue, registry, burst=True).run()  # it fails again: dead once more
        await check(c, "POST", "/v1/jobs/{job_id}/retry", 200, ids=dead)
        await check(c, "POST", "/v1/jobs/{job_id}/retry", 409, ids=dead)
        # every dead letter is asked for by name, not by leaving the filters out
        await check(admin, "POST", "/v1/admin/dead-letters/replay", 422, json={"limit": 5})
        await check(admin, "POST", "/v1/admin/dead-letters/replay", 422)  # no body
        await check(
            admin, "POST", "/v1/admin/dead-letters/replay", 200, json={"limit": 5, "all": True}
        )
        await check(admin, "GET", "/v1/admin/stats", 200)
        q = {"name": "default"}
        await check(admin, "POST", "/v1/admin/queues/{name}/pause", 200, ids=q)
        await check(admin, "PUT", "/v1/admin/queues/{name}/limits", 200, ids=q, json={"rate": 5})
        await check(admin, "GET", "/v1/admin/queues", 200)
        await check(admin, "PUT", "/v1/admin/queues/{name}/limits", 200, ids=q, json={})
        await check(admin, "POST", "/v1/admin/queues/{name}/resume", 200, ids=q)
        await check(admin, "POST", "/v1/admin/queues/{name}/unblock", 200, ids=q)
        await check(admin, "GET", "/v1/admin/tasks", 200)
        breaker = {"name": "conformance-breaker"}
        opened = {"seconds": 30, "reason": "conformance"}
        await check(admin, "POST", "/v1/admin/breakers/{name}/open", 200, ids=breaker, json=opened)
        await check(admin, "GET", "/v1/admin/breakers", 200)
        await check(admin, "POST", "/v1/admin/breakers/{name}/close", 200, ids=breaker)
        scaling = "/v1/admin/queues/{name}/scaling"
        await check(admin, "GET", scaling, 200, ids=q, params={"slots": 4, "max": 10})
        await check(admin, "GET", scaling, 404, ids={"name": "never-named"})
        await check(admin, "GET", scaling, 422, ids=q, params={"min": 3, "max": 2})
        await check(admin, "GET", scaling, 400, ids=q, params={"slots": 0})
        await check(admin, "GET", "/metrics", 200)

        # the console's routes
        await check(admin, "GET", "/v1/admin/jobs", 200, params={"state": "succeeded", "limit": 2})
        await check(admin, "GET", "/v1/admin/jobs/{job_id}", 200, ids=ids)
        await check(admin, "GET", "/v1/admin/jobs/{job_id}/payload", 200, ids=ids)
        await check(admin, "GET", "/v1/admin/jobs/{job_id}/result", 200, ids=ids)
        nobody = {"job_id": queue.keys.new_id()}
        for route in ("/v1/admin/jobs/{job_id}", "/v1/admin/jobs/{job_id}/payload"):
            await check(admin, "GET", route, 404, ids=nobody)
        await check(admin, "GET", "/v1/admin/jobs/{job_id}/result", 404, ids=nobody)
        await check(admin, "POST", "/v1/admin/jobs/{job_id}/cancel", 404, ids=nobody)
        await check(admin, "POST", "/v1/admin/jobs/{job_id}/cancel", 409, ids=ids)
        fresh = (await c.post("/v1/jobs", json={"type": "echo"})).json()
        await check(
            admin, "POST", "/v1/admin/jobs/{job_id}/cancel", 200, ids={"job_id": fresh["id"]}
        )
        later = (await c.post("/v1/jobs", json={"type": "echo", "delay": 3600})).json()
        promote = "/v1/admin/jobs/{job_id}/promote"
        await check(admin, "POST", promote, 200, ids={"job_id": later["id"]})
        await check(admin, "POST", promote, 409, ids={"job_id": later["id"]})
        await check(admin, "POST", promote, 404, ids=nobody)
        await check(admin, "POST", "/v1/admin/queues/{name}/purge", 200, ids=q)
        await check(admin, "GET", "/v1/admin/workers", 200)
        await check(admin, "GET", "/v1/admin/events", 200, params={"ids": job["id"]})
        await check(admin, "GET", "/v1/admin/events", 404, params={"ids": nobody["job_id"]})
        await check(admin, "GET", "/v1/admin/audit", 200, params={"limit": 3})

        batch_body = {"type": "echo", "items": [1, 2], "callback": {"type": "echo"}}
        batch = (await check(c, "POST", "/v1/batches", 202, json=batch_body)).json()
        await check(c, "POST", "/v1/batches", 422, json={"type": "echo", "items": []})
        bid = {"batch_id": batch["id"]}
        await check(c, "GET", "/v1/batches/{batch_id}", 200, ids=bid)
        await check(c, "POST", "/v1/batches/{batch_id}/retry", 200, ids=bid)
        await check(c, "POST", "/v1/batches/{batch_id}/cancel", 200, ids=bid)
        await check(c, "GET", "/v1/batches/{batch_id}", 404, ids={"batch_id": nobody["job_id"]})

        spec = {"name": "hourly", "type": "echo", "cron": "0 * * * *", "timezone": "Europe/Paris"}
        schedule = (await check(c, "POST", "/v1/schedules", 201, json=spec)).json()
        await check(c, "POST", "/v1/schedules", 409, json=spec)
        sid = {"schedule_id": schedule["id"]}
        await check(c, "GET", "/v1/schedules", 200)
        await check(c, "GET", "/v1/schedules/{schedule_id}", 200, ids=sid)
        await check(c, "POST", "/v1/schedules/{schedule_id}/pause", 200, ids=sid)
        await check(c, "POST", "/v1/schedules/{schedule_id}/resume", 200, ids=sid)
        patch = "/v1/schedules/{schedule_id}"
        await check(c, "PATCH", patch, 200, ids=sid, json={"interval": 60})
        await check(c, "PATCH", patch, 422, ids=sid, json={"interval": 60, "cron": "* * * * *"})
        other = {"name": "other", "type": "echo", "interval": 60}
        await check(c, "POST", "/v1/schedules", 201, json=other)
        await check(c, "PATCH", patch, 409, ids=sid, json={"name": "other"})
        run = "/v1/schedules/{schedule_id}/run"
        keyed = {"headers": {"idempotency-key": "run-once"}}
        await check(c, "POST", run, 202, ids=sid, **keyed)
        await check(c, "POST", run, 200, ids=sid, **keyed)
        await check(c, "DELETE", "/v1/schedules/{schedule_id}", 204, ids=sid)
        await check(c, "POST", run, 404, ids=sid)
        await check(c, "GET", "/v1/schedules/{schedule_id}", 404, ids=sid)

    async with pg_api.client(None) as anonymous:
        for path in ("/healthz", "/readyz", "/v1/openapi.json", "/dashboard"):
            await check(anonymous, "GET", path, 200)
    # every operation of the document was met in at least one answer
    documented = {
        (m.upper(), p) for p, item in check.schema.raw_schema["paths"].items() for m in item
    }
    met = {(m, p) for m, p, _ in check.seen}
    # the worker routes are driven through their answers in test_http_worker.py
    met |= {(m, p) for m, p in documented if p.startswith("/v1/worker/")}
    assert documented - met <= {("GET", "/v1/admin/dashboard/stream")}, documented - met


def _request_schemas(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every component schema a request body uses, directly or nested, by name."""
    components = document["components"]["schemas"]
    names: list[str] = []

    def refs(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                name = ref.rsplit("/", 1)[1]
                if name not in names:
                    names.append(name)
                    refs(components[name])
            for value in node.values():
                refs(value)
        elif isinstance(node, list):
            for value in node:
                refs(value)

    for operations in document["paths"].values():
        for operation in operations.values():
            if isinstance(operation, dict) and "requestBody" in operation:
                refs(operation["requestBody"])
    return {name: components[name] for name in names}


async def test_every_queue_a_request_names_is_documented_with_its_pattern(
    pg_api: ApiServer,
) -> None:
    """A queue name breaking its pattern is refused (422) wherever a request names one: the
    document says so wherever it does (the fuzz test found `POST /v1/schedules` saying
    nothing, and a schedule of queue "" refused as valid data)."""
    async with pg_api.client(None) as anonymous:
        document = (await anonymous.get("/v1/openapi.json")).json()
    named: dict[str, list[Any]] = {}

    def queues(name: str, node: Any) -> None:
        # a schema's own properties, and those of its variants (JobSpec and ScheduleSpec are
        # one variant per known task: api/task_schemas.py)
        if isinstance(node, dict):
            prop = node.get("properties", {}).get("queue")
            if prop is not None:
                strings = [p for p in prop.get("anyOf", [prop]) if p.get("type") == "string"]
                named.setdefault(name, []).extend(s.get("pattern") for s in strings)
            for value in node.values():
                queues(name, value)
        elif isinstance(node, list):
            for value in node:
                queues(name, value)

    for name, schema in _request_schemas(document).items():
        queues(name, schema)
    assert "ScheduleSpec" in named and "JobSpec" in named, named
    assert all(set(patterns) == {QUEUE_NAME_RE.pattern} for patterns in named.values()), named
