"""The API's Postgres part: status and results of jobs Redis no longer holds, listing and
history, readiness, and the write-behind lag that drives back-pressure."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import asyncpg
import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import console_records, schedules, webhooks
from jobtier.api import result_content as results
from jobtier.api import spec as oa
from jobtier.api.app import Extension
from jobtier.api.auth import tenant_of
from jobtier.api.http import encoded, job_id_of, job_not_found
from jobtier.api.params import (
    CREATED_AFTER,
    JOB_FILTERS,
    bad,
    job_page,
    parse_query,
)
from jobtier.api.problems import PG_DOWN, Problem, postgres_or_503
from jobtier.api.sealed import opened
from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.model import Dependency, JobStatus
from jobtier.engine.cron import CronMirror
from jobtier.engine.queue import Queue
from jobtier.flows.reads import open_dependency
from jobtier.persist.audit_store import AuditStore
from jobtier.persist.db import (
    UNAVAILABLE,
    Pool,
    applied_migrations,
    create_pool,
    migrations,
    query,
)
from jobtier.persist.outbox_docs import outbox_docs
from jobtier.persist.pg_reader import MAX_LIMIT, PgReader, Transition
from jobtier.persist.schedule_store import ScheduleStore
from jobtier.streams.group import shared_lag
from jobtier.webhooks.deliveries import deliver_ended
from jobtier.webhooks.safety import Resolver

log = logging.getLogger("jobtier.api")


class JobPage(msgspec.Struct):
    jobs: list[JobStatus]
    next_cursor: str | None
    lag: dict[str, float]


class History(msgspec.Struct):
    id: str
    transitions: list[Transition]
    lag: dict[str, float]


OUTBOX_COUNTED = 100_000  # outbox rows counted at most (the alert watches the oldest's age)
OUTBOX_EVERY = 5.0  # s: the backlog read at most this often, whatever the scrapes
OUTBOX_TIMEOUT = 1.0  # s: a backlog read taking longer is skipped
# ms a cancel of an outbox row waits for a relay holding it (then: 503, send it again)
CANCEL_LOCK_MS = 5_000
READY_SECONDS = 1.0  # s: /readyz's look at Postgres, well inside a probe's limit (3 s in deploy/)
BACKLOG_UNREAD: tuple[type[BaseException], ...] = (*UNAVAILABLE, asyncpg.PostgresError)


class PostgresExtension(Extension):
    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings
        self.pool: Pool | None = None
        self.reader: PgReader | None = None
        self.queue: Queue | None = None
        self._lag = (0, 0.0)
        self._lag_until = 0.0  # monotonic time until which _lag is current
        self._backlog: tuple[int, float] | None = None
        self._backlog_at = -OUTBOX_EVERY
        self._probe: asyncio.Task[str | None] | None = None  # /readyz's look at Postgres
        self._probe_began = 0.0
        self.operations = [
            operations(settings),
            schedules.operations(settings),
            webhooks.operations(settings),
            results.operations(settings),
            console_records.operations(settings),
        ]
        self.openapi_types = [
            JobPage,
            History,
            *schedules.OPENAPI_TYPES,
            *webhooks.OPENAPI_TYPES,
            *console_records.OPENAPI_TYPES,
        ]
        self.openapi_constraints = [lambda c: schedules.constrain(c, settings), webhooks.constrain]
        # host name -> addresses for the callback URL checks (None: the system's DNS)
        self.webhook_resolver: Resolver | None = None
        self.status_fallback = self._status_docs
        self.result_fallback = self._result
        self.dependencies_fallback = self._dependencies
        self.postgres_ready = self._ready
        self.lag = self._lag_entries
        self.outbox_backlog = self._outbox_backlog
        self.outbox_doc = self._outbox_doc
        self.outbox_cancel = self._outbox_cancel

    async def open(self, settings: Settings, queue: Queue) -> None:
        self.queue = queue
        # min_size=0: the API starts (and serves what Redis holds) while Postgres is down
        self.pool = await create_pool(settings.database_url, min_size=0, max_size=8)
        self.reader = PgReader(self.pool)
        self.state["pg_reader"] = self.reader
        self.state["schedule_store"] = ScheduleStore(self.pool)
        self.state["audit_store"] = AuditStore(self.pool)
        self.state["cron"] = CronMirror(queue.redis, queue.keys, queue.scripts)
        self.state["pg_extension"] = self
        self.state["webhooks"] = webhooks.WebhookService(
            self.pool, queue, settings, self.webhook_resolver
        )

    async def close(self) -> None:
        probe = self._probe
        silent = probe is not None and not probe.done()
        if probe is not None and silent:  # a look at a Postgres that has not answered: its
            probe.cancel()  # connection would not be handed back, and closing waits for it
        if self.pool is not None:
            if silent:
                self.pool.terminate()
            else:
                await self.pool.close()

    async def _status_docs(self, job_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        assert self.reader is not None
        with postgres_or_503(logged=True):
            return await self.reader.status_docs(job_ids)

    async def _result(self, job_id: str, tenant: str) -> dict[str, Any] | None:
        assert self.reader is not None
        with postgres_or_503(logged=True):
            found = await self.reader.result(job_id, tenant)
            if found is None:
                return await self._outbox_result(job_id, tenant)
            status = await self.reader.status_doc(job_id)
        if status is None:
            return None
        doc = orjson.loads(status[1])
        result = found.result
        if result is not None:  # the tenant's own: an encrypted result opened
            assert self.queue is not None
            result = opened(self.queue.store.keyring, job_id, "result", result)
        answer = {
            "id": job_id,
            "state": found.state.value,
            "version": found.version,
            "result": orjson.loads(result) if result is not None else None,
            "error": doc.get("error"),
        }
        if found.ref is not None:  # kept in the result store: streamed from result_url
            answer["result_url"] = f"/v1/jobs/{job_id}/result/content"
        return answer

    async def _outbox_doc(self, job_id: str, tenant: str | None) -> bytes | None:
        """The status document of the tenant's job (any tenant's with None: the console) that
        only the outbox holds (not relayed yet, or refused by the relay; not one relayed a
        moment ago, which Redis has or lost), else None."""
        assert self.pool is not None
        with postgres_or_503(logged=True):
            known = (await outbox_docs([job_id], self.pool, relayed=False)).get(job_id)
        if known is None or tenant not in (None, known[0]):
            return None
        return known[1]

    async def _outbox_cancel(self, job_id: str, tenant: str | None) -> bytes | None:
        """Cancel the tenant's job (any tenant's with None) that only the outbox holds, not
        relayed yet: the relay never takes it (``outbox_cancel``). Its status document, or
        None if no such row is left (a relay took it meanwhile). Its webhooks are made with
        it, as for a job cancelled in Redis."""
        assert self.pool is not None
        with postgres_or_503(logged=True):
            async with self.pool.acquire() as conn, conn.transaction():
                # a relay holding the row (its Redis submit under way) is waited for, not past
                # CANCEL_LOCK_MS: a Redis that froze under that relay must not hold the API's
                # connections too
                await conn.execute(f"SET LOCAL lock_timeout = {int(CANCEL_LOCK_MS)}")
                try:
                    cancelled = await conn.fetchval(query("outbox_cancel"), job_id, tenant)
                except asyncpg.LockNotAvailableError:
                    # passing: a 503 with Retry-After, which clients send again
                    detail = (
                        f"job {job_id}'s outbox row is held by a relay (taking it into Redis, "
                        "or setting it aside): send the cancel again"
                    )
                    raise Problem(
                        503, "unavailable", detail, headers={"retry-after": "1"}
                    ) from None
                await conn.execute("SET LOCAL lock_timeout = 0")  # (the webhooks' writes)
                if cancelled is None:
                    return None
                ended = (await outbox_docs([job_id], conn, relayed=False))[job_id]
                await deliver_ended(conn, [ended])  # its webhooks, or neither
        return ended[1]

    async def _outbox_result(self, job_id: str, tenant: str) -> dict[str, Any] | None:
        """A job only the outbox holds (not relayed yet, refused by its relay, or relayed a
        moment ago and not yet written by the persister): no result, as its status reads
        (``outbox_docs``, as ``status_docs`` finds it); None for any other job."""
        assert self.pool is not None
        known = (await outbox_docs([job_id], self.pool)).get(job_id)
        if known is None or known[0] != tenant:
            return None
        doc = orjson.loads(known[1])
        return {
            "id": job_id,
            "state": doc["state"],
            "version": doc["version"],
            "result": None,
            "error": doc["error"],
        }

    async def _dependencies(self, job_id: str, tenant: str) -> list[Dependency] | None:
        assert self.reader is not None and self.queue is not None
        with postgres_or_503(logged=True):
            found = await self.reader.dependencies(job_id, tenant)
            if found is None and self.pool is not None:
                # still in the outbox: bound to what it names at its relay, pending till then
                named = await self.pool.fetchval(query("outbox_depends_on"), job_id, tenant)
                if named is not None:
                    return [Dependency(id=dep, state="pending") for dep in named]
        keyring = self.queue.store.keyring
        return None if found is None else [open_dependency(d, keyring) for d in found]

    async def _ready(self) -> str | None:
        """Postgres's problem for /readyz, or None; within ``READY_SECONDS`` whatever it does.
        A check that gets no answer (a server that went silent) is left to finish in the
        background, and the next readiness call waits on it rather than starting another: a
        silent server holds one connection of the pool, not one per probe."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._check_ready())
            self._probe_began = time.monotonic()
        done, _ = await asyncio.wait({self._probe}, timeout=READY_SECONDS)
        if not done:
            silent = time.monotonic() - self._probe_began
            return f"unreachable: no answer within {READY_SECONDS:g} s (asked {silent:.0f} s ago)"
        return self._probe.result()

    async def _check_ready(self) -> str | None:
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
        """(transitions not yet in Postgres, age of the oldest in seconds): the count the API
        processes share (``shared_lag``), kept here as long as it is current there (about a
        second), so that a submit's admission asks Redis for nothing."""
        assert self.queue is not None
        now = time.monotonic()
        if now >= self._lag_until:
            transitions, age, current_for = await shared_lag(self.queue.redis, self.queue.keys)
            self._lag, self._lag_until = (transitions, age), now + current_for
        return self._lag

    async def _lag_entries(self) -> int:
        return (await self.current_lag())[0]

    async def _outbox_backlog(self) -> tuple[int, float] | None:
        """(outbox rows not yet relayed, up to ``OUTBOX_COUNTED``; the oldest's age in
        seconds, 0 with none), read at most every ``OUTBOX_EVERY`` seconds, within
        ``OUTBOX_TIMEOUT`` (a scrape must not wait on Postgres: its Redis gauges go first);
        None while Postgres does not answer it (``/readyz`` says why)."""
        assert self.pool is not None
        now = time.monotonic()
        if now - self._backlog_at < OUTBOX_EVERY:
            return self._backlog
        self._backlog_at = now
        try:
            async with asyncio.timeout(OUTBOX_TIMEOUT):
                row = await self.pool.fetchrow(query("outbox_backlog"), OUTBOX_COUNTED)
        except asyncpg.UndefinedTableError:  # not migrated yet
            self._backlog = None
        except BACKLOG_UNREAD as exc:
            log.warning("event=outbox_backlog_unread error=%r", exc)
            self._backlog = None
        else:
            assert row is not None  # one row, always
            self._backlog = int(row["rows"]), float(row["age"] or 0.0)
        return self._backlog

    async def lag_document(self) -> dict[str, float]:
        """The lag as the listings and a job's history show it."""
        entries, seconds = await self.current_lag()
        return {"transitions": entries, "seconds": round(seconds, 3)}


def operations(settings: Settings) -> oa.Paths:
    """The tenant's listing and a job's history."""
    paths = oa.Paths(settings)
    paths.add(
        "GET /v1/jobs",
        list_jobs,
        "The tenant's jobs from Postgres, newest first; says how far behind the write-behind is",
        oa.page("JobPage"),
        params=LIST_PARAMS,
    )
    paths.add(
        "GET /v1/jobs/{job_id}/history",
        history,
        "Every persisted change of the job, oldest first, and the write-behind lag (a job not "
        "yet persisted has an empty history)",
        oa.returns(200, "History", "the transitions persisted so far"),
        oa.JOB_404,
    )
    return paths


LIST_PARAMS = [*JOB_FILTERS, CREATED_AFTER, *job_page(MAX_LIMIT)]


def postgres_extension(settings: Settings) -> PostgresExtension:
    return PostgresExtension(settings)


async def list_jobs(request: Request) -> Response:
    """The tenant's jobs from Postgres, newest first, keyset-paginated; says how far behind
    the write-behind is (jobs changed within that window may show an older state)."""
    tenant = tenant_of(request)
    q = parse_query(request, LIST_PARAMS)
    reader: PgReader = request.state.pg_reader
    try:
        with postgres_or_503(logged=True):
            jobs, cursor = await reader.list_jobs(tenant, **q)  # named as its arguments
            page = JobPage(jobs, cursor, await request.state.pg_extension.lag_document())
    except InvalidRequest as exc:
        raise bad(exc.field, str(exc)) from None
    return encoded(page)


async def history(request: Request) -> Response:
    """Every persisted change of one job, oldest first, and how far behind the write-behind
    is: a job Redis holds whose changes are not in Postgres yet (just created) has an empty
    or short history, not a 404."""
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    reader: PgReader = request.state.pg_reader
    with postgres_or_503(logged=True):
        transitions = await reader.history(job_id, tenant)
        lag_doc = await request.state.pg_extension.lag_document()
    if transitions is None:
        if await request.state.reader.get_for(job_id, tenant) is None:
            raise job_not_found(job_id)
        transitions = []
    return encoded(History(job_id, transitions, lag_doc))
