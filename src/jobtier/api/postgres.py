"""The API's Postgres part: status and results of jobs Redis no longer holds, listing and
history, readiness, and the write-behind lag that drives back-pressure."""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

import asyncpg
import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jobtier.api import openapi as oa
from jobtier.api import schedules
from jobtier.api.app import Extension
from jobtier.api.auth import tenant_of
from jobtier.api.http import JSON
from jobtier.api.problems import Problem, not_found
from jobtier.config import Settings
from jobtier.errors import InvalidRequest
from jobtier.model import QUEUE_NAME_RE, JobStatus, State
from jobtier.persist.db import Pool, applied_migrations, create_pool, migrations
from jobtier.persist.pg_reader import PgReader, Transition, lag
from jobtier.persist.schedule_store import ScheduleStore
from jobtier.queue import Queue
from jobtier.schedules import CronMirror

log = logging.getLogger("jobtier.api")

# what Postgres raises when it is down or restarting
PG_DOWN = (OSError, asyncpg.PostgresConnectionError, asyncpg.CannotConnectNowError, TimeoutError)


def unavailable(exc: BaseException) -> Problem:
    log.warning("event=postgres_unavailable error=%r", exc)
    return Problem(
        503, "unavailable", "Postgres is unavailable; try again", headers={"retry-after": "2"}
    )


class JobPage(msgspec.Struct):
    jobs: list[JobStatus]
    next_cursor: str | None
    lag: dict[str, float]


class History(msgspec.Struct):
    id: str
    transitions: list[Transition]
    lag: dict[str, float]


class PostgresExtension(Extension):
    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings
        self.pool: Pool | None = None
        self.reader: PgReader | None = None
        self.queue: Queue | None = None
        self._lag = (0, 0.0)
        self._lag_at = 0.0
        self.routes = [
            Route("/v1/jobs", list_jobs, methods=["GET"]),
            Route("/v1/jobs/{job_id}/history", history, methods=["GET"]),
            *schedules.routes,
        ]
        self.openapi_paths = {**OPENAPI_PATHS, **schedules.OPENAPI_PATHS}
        self.openapi_types = [JobPage, History, *schedules.OPENAPI_TYPES]
        self.status_fallback = self._status_docs
        self.result_fallback = self._result
        self.postgres_ready = self._ready
        self.lag = self._lag_entries

    async def open(self, settings: Settings, queue: Queue) -> None:
        self.queue = queue
        # min_size=0: the API starts (and serves what Redis holds) while Postgres is down
        self.pool = await create_pool(settings.database_url, min_size=0, max_size=8)
        self.reader = PgReader(self.pool)
        self.state["pg_reader"] = self.reader
        self.state["schedule_store"] = ScheduleStore(self.pool)
        self.state["cron"] = CronMirror(queue.redis, queue.keys, queue.scripts)
        self.state["pg_extension"] = self

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    async def _status_docs(self, job_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        assert self.reader is not None
        try:
            return await self.reader.status_docs(job_ids)
        except PG_DOWN as exc:
            raise unavailable(exc) from None

    async def _result(self, job_id: str, tenant: str) -> dict[str, Any] | None:
        assert self.reader is not None
        try:
            found = await self.reader.result(job_id, tenant)
            status = await self.reader.status_doc(job_id) if found else None
        except PG_DOWN as exc:
            raise unavailable(exc) from None
        if found is None or status is None:
            return None
        doc = orjson.loads(status[1])
        return {
            "id": job_id,
            "state": found.state.value,
            "version": found.version,
            "result": orjson.loads(found.result) if found.result is not None else None,
            "error": doc.get("error"),
        }

    async def _ready(self) -> str | None:
        assert self.pool is not None
        try:
            async with self.pool.acquire() as conn:
                applied = set(await applied_migrations(conn))
        except PG_DOWN as exc:
            return f"unreachable: {exc}"
        missing = [name for name, _ in migrations() if name not in applied]
        return (
            f"migrations not applied: {', '.join(missing)} (run `jobtier migrate`)"
            if missing
            else None
        )

    async def current_lag(self) -> tuple[int, float]:
        """(transitions not yet in Postgres, age of the oldest in seconds), cached ~1 s."""
        assert self.queue is not None
        now = time.monotonic()
        if now - self._lag_at > 1.0:
            self._lag = await lag(self.queue.redis, self.queue.keys)
            self._lag_at = now
        return self._lag

    async def _lag_entries(self) -> int:
        return (await self.current_lag())[0]


OPENAPI_PATHS: dict[str, Any] = {
    "/v1/jobs": {
        "get": {
            "summary": "The tenant's jobs from Postgres, newest first; says how far behind the write-behind is",
            "parameters": [
                {"name": "state", "in": "query", "schema": {"type": "string", "enum": [s.value for s in State]}},
                {"name": "type", "in": "query", "schema": {"type": "string"}},
                {"name": "queue", "in": "query", "schema": {"type": "string", "pattern": QUEUE_NAME_RE.pattern}},
                {"name": "created_after", "in": "query", "schema": {"type": "string", "format": "date-time"}},
                {"name": "cursor", "in": "query", "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
                {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["desc", "asc"]}},
            ],
            "responses": {
                "200": oa.json_response("JobPage", "a page; next_cursor is null on the last"),
                "400": oa.problem("bad parameter"),
                "503": oa.problem("Postgres unavailable"),
                **oa.AUTH_ERRORS,
            },
        }
    },
    "/v1/jobs/{job_id}/history": {
        "get": {
            "summary": "Every persisted change of the job, oldest first",
            "parameters": [oa.JOB_ID],
            "responses": {
                "200": oa.json_response("History", "the transitions"),
                "404": oa.problem("unknown job"),
                "503": oa.problem("Postgres unavailable"),
                **oa.AUTH_ERRORS,
            },
        }
    },
}  # fmt: skip


def postgres_extension(settings: Settings) -> PostgresExtension:
    return PostgresExtension(settings)


async def _lag_document(request: Request) -> dict[str, float]:
    entries, seconds = await request.state.pg_extension.current_lag()
    return {"transitions": entries, "seconds": round(seconds, 3)}


async def list_jobs(request: Request) -> Response:
    """The tenant's jobs from Postgres, newest first, keyset-paginated; says how far behind
    the write-behind is (jobs changed within that window may show an older state)."""
    tenant = tenant_of(request)
    q = request.query_params
    unknown = set(q) - {"state", "type", "queue", "created_after", "cursor", "limit", "order"}
    if unknown:
        raise Problem(400, "bad-request", f"unknown parameters: {', '.join(sorted(unknown))}")
    limit_raw = q.get("limit", "50")
    if not limit_raw.isdigit():
        raise Problem(400, "bad-request", "limit must be an integer", field="limit")
    created_after: datetime | None = None
    if "created_after" in q:
        try:
            created_after = datetime.fromisoformat(q["created_after"].replace("Z", "+00:00"))
        except ValueError:
            raise Problem(
                400, "bad-request", "created_after must be an ISO-8601 time", field="created_after"
            ) from None
    reader: PgReader = request.state.pg_reader
    try:
        jobs, cursor = await reader.list_jobs(
            tenant,
            state=q.get("state"),
            type=q.get("type"),
            queue=q.get("queue"),
            created_after=created_after,
            cursor=q.get("cursor"),
            limit=int(limit_raw),
            order=q.get("order", "desc"),
        )
        page = JobPage(jobs, cursor, await _lag_document(request))
    except InvalidRequest as exc:
        raise Problem(400, "bad-request", str(exc), field=exc.field) from None
    except PG_DOWN as exc:
        raise unavailable(exc) from None
    return Response(msgspec.json.encode(page), media_type=JSON)


async def history(request: Request) -> Response:
    """Every persisted change of one job, oldest first."""
    tenant = tenant_of(request)
    job_id = request.path_params["job_id"]
    reader: PgReader = request.state.pg_reader
    try:
        transitions = await reader.history(job_id, tenant)
        lag_doc = await _lag_document(request)
    except PG_DOWN as exc:
        raise unavailable(exc) from None
    if transitions is None:
        raise not_found(f"job {job_id}")
    return Response(msgspec.json.encode(History(job_id, transitions, lag_doc)), media_type=JSON)
