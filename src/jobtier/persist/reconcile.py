"""Reconcile Redis from Postgres: put back the jobs a Redis failover lost.

Redis replicates asynchronously: a replica promoted after its primary died may lack the
primary's last writes, which the persister may already have written to Postgres. A job is
then absent from Redis, or there at an older version than Postgres's. A reconcile pass finds
those jobs and writes them back as Postgres has them (``store/lua/reconcile.lua``: one
atomic, version-checked script per batch and shard, which never moves a job back):

* which jobs: those with a transition in Postgres in the last ``since`` seconds, found
  through the history's ``at`` (a BRIN index, cheap to keep: migration 0019), streamed from
  a cursor in batches of ``batch_size``;
* per batch, Redis's version of each job in one pipelined read (one round trip per node);
  only the jobs Redis lacks or holds at a lower version go on (a job Redis holds at a later
  version, not persisted yet, is the normal case and is left alone);
* a job running in both under the same lease (worker, attempt, and the claim Postgres's
  history has last) lost only a heartbeat's write (progress, a checkpoint): its worker still
  runs it, so it is moved forward in place, its lease kept, not put back in its queue;
* a finished job Redis no longer holds because its retention ran out is not brought back.

``jobtier reconcile`` runs one pass (``--dry-run``: the comparison only). A persister runs
one whenever a Redis primary has a run id it has not seen (``run_reconciling``): a replica
promoted, a server restarted without its data, a node replaced; and a second one a minute
later, for the transitions Postgres received meanwhile from batches read before. Each repair is
logged (``event=reconciled``) and counted in ``jobtier_reconciled_total{kind}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import RESULT_REF
from jobtier.core.sealing import PREFIX
from jobtier.engine.validate import request_hash_of
from jobtier.persist.batch import BATCH_TIMEOUT
from jobtier.persist.db import AnyConnection, Connection, close, connect
from jobtier.runtime.loop import FAULTS, wait_for
from jobtier.store import format as job_format
from jobtier.store.calls import Call
from jobtier.store.redis import RedisClient, info_of_primaries
from jobtier.store.scripts import Scripts

log = logging.getLogger("jobtier.reconcile")

# what makes a persister's pass fail and be tried again: Redis or Postgres away (a Postgres
# connection lost mid-pass is an InterfaceError, not a PostgresError)
_PASS_FAILED: tuple[type[BaseException], ...] = (
    *FAULTS,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    TimeoutError,
)
# a persister's second pass after a failover, once every batch read before it has committed
# or been given up (persist/batch.py BATCH_TIMEOUT)
SETTLE_SECONDS = BATCH_TIMEOUT
BATCH_SIZE = 500  # jobs compared per Redis round trip (and restored per script call)
KINDS = ("restored", "advanced", "requeued")  # what a repair was (reconcile.lua)
FINISHED = frozenset({"succeeded", "failed", "cancelled"})

_JOBS = """SELECT j.id, j.tenant, j.type, j.priority, j.state, j.version, j.attempt,
j.max_attempts, j.payload, j.idempotency_key, j.result, j.result_size, j.result_ref, j.doc, j.queue
"""
# the jobs with a transition at or after $1, as Postgres holds them now; every job not
# finished, however long ago it last moved (for a Redis that lost its data)
_CHANGED = f"{_JOBS} FROM jobs j WHERE j.id IN (SELECT job_id FROM job_transitions WHERE at >= $1)"
_LIVE = f"""{_JOBS} FROM jobs_by_state b JOIN jobs j ON j.id = b.id
WHERE b.state IN ('waiting', 'scheduled', 'queued', 'running')"""
_LARGE_RESULTS = "SELECT job_id, result FROM job_results WHERE job_id = ANY($1::text[])"
_WAITING_FOR = "SELECT DISTINCT job_id FROM job_dependencies WHERE job_id = ANY($1::text[])"
_DEPENDENCIES = """
SELECT job_id, depends_on, child FROM job_dependencies
WHERE job_id = ANY($1::text[]) ORDER BY job_id, position
"""
# the version of each job's latest claim (queued -> running): its lease version
_CLAIMS = """
SELECT DISTINCT ON (job_id) job_id, version FROM job_transitions
WHERE job_id = ANY($1::text[]) AND to_state = 'running' AND from_state <> 'running'
ORDER BY job_id, version DESC
"""
_DEPENDENTS = """
SELECT depends_on, job_id FROM job_dependencies WHERE depends_on = ANY($1::text[])
"""


class _Doc(msgspec.Struct):
    """What a restore takes from the stored status document, byte for byte as rendered."""

    created_at: str
    updated_at: str
    run_at: str | None = None
    error: msgspec.Raw = msgspec.Raw(b"null")
    progress: msgspec.Raw = msgspec.Raw(b"null")
    cancel_requested: bool = False
    worker: str | None = None


_doc_decoder = msgspec.json.Decoder(_Doc)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _ms(iso: str) -> int:
    return (datetime.fromisoformat(iso) - _EPOCH) // timedelta(milliseconds=1)


def _raw(value: msgspec.Raw) -> bytes:
    data = bytes(value)
    return b"" if data == b"null" else data


@dataclass
class Report:
    """What a pass found and did."""

    dry_run: bool = False
    checked: int = 0  # jobs Postgres changed in the window
    repaired: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    expired: int = 0  # finished, absent from Redis as their retention ends there: left so
    skipped: int = 0  # found behind, but a live transition caught up before the script ran
    incomplete: int = 0  # Postgres lacks their submit (payload): left for the persister
    seconds: float = 0.0
    unmarked: tuple[int, ...] = ()  # shards without their format mark: their data lost

    @property
    def total(self) -> int:
        return sum(self.repaired.values())

    def lines(self) -> list[str]:
        verb = "would repair" if self.dry_run else "repaired"
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.repaired.items())
        out = [
            f"checked {self.checked} jobs Postgres changed in the window ({self.seconds:.1f} s)",
            f"{verb} {self.total}: {kinds}",
        ]
        if self.expired:
            out.append(f"left {self.expired} finished jobs past their Redis retention")
        if self.skipped:
            out.append(f"skipped {self.skipped}: Redis caught up meanwhile")
        if self.incomplete:
            out.append(f"left {self.incomplete} whose submit Postgres has not written yet")
        if self.unmarked:  # (their Redis lost its data: every job not finished compared)
            what = job_format.shard_list(self.unmarked)
            out.append(f"{what}: no format mark; `jobtier job-format --upgrade` sets it")
        return out


@dataclass
class _Job:
    """One job Redis lacks or holds behind Postgres: its row, and what Redis holds."""

    row: asyncpg.Record
    was: str  # '' absent, else '<state> <version>'
    held: _Lease | None = None  # the lease Redis holds it under, when running there
    claimed: int | None = None  # running in Postgres: the version of its latest claim

    @property
    def id(self) -> str:
        return str(self.row["id"])

    def same_lease(self) -> bool:
        """Running in both under the same lease (reconcile.lua same_lease)."""
        row, held = self.row, self.held
        return (
            row["state"] == "running"
            and held is not None
            and held.worker == (_doc_decoder.decode(row["doc"]).worker or "")
            and held.attempt == row["attempt"]
            and (self.claimed is None or self.claimed == held.version)
        )

    def kind(self) -> str:
        if self.row["state"] == "running" and not self.same_lease():
            return "requeued"
        return "advanced" if self.was else "restored"


@dataclass(frozen=True)
class _Lease:
    """A running job's lease as Redis holds it: its worker, attempt and lease version."""

    worker: str
    attempt: int
    version: int


class Reconciler:
    """Compares and repairs, batch by batch; ``on_repair(kind)`` counts each repair."""

    def __init__(
        self,
        settings: Settings,
        redis: RedisClient,
        *,
        batch_size: int = BATCH_SIZE,
        on_repair: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.prefix, settings.shards)
        self.scripts = Scripts(redis, self.keys)
        self.batch_size = max(1, batch_size)
        self.on_repair = on_repair

    async def run(
        self,
        conn: AnyConnection,
        since: float,
        *,
        dry_run: bool = False,
        live_shards: frozenset[int] = frozenset(),
    ) -> Report:
        """One pass over the jobs Postgres changed in the last ``since`` seconds, then over
        every job of ``live_shards`` not finished, however old (shards whose Redis lost its
        data)."""
        started = time.monotonic()
        report = Report(dry_run=dry_run)
        cutoff = datetime.now(UTC) - timedelta(seconds=since)
        async for rows in self._rows(conn, cutoff, live_shards):
            report.checked += len(rows)
            behind = await self._behind(rows, report)
            if not behind:
                continue
            await _claims(conn, behind)
            if dry_run:
                for job in behind:
                    report.repaired[job.kind()] += 1
                    log.info(
                        "event=reconcile_needed job=%s from=%s to=%s",
                        job.id,
                        _said(job.was),
                        f"{job.row['state']}:{job.row['version']}",
                    )
                continue
            await self._restore(conn, behind, report)
        report.seconds = time.monotonic() - started
        return report

    async def _rows(
        self, conn: AnyConnection, cutoff: datetime, live_shards: frozenset[int]
    ) -> AsyncIterator[list[asyncpg.Record]]:
        async for rows in _batches(conn, _CHANGED, self.batch_size, cutoff):
            yield rows
        if live_shards:
            shard_of = self.keys.shard_of
            async for rows in _batches(conn, _LIVE, self.batch_size):
                if mine := [r for r in rows if shard_of(r["id"]) in live_shards]:
                    yield mine

    async def _behind(self, rows: Sequence[asyncpg.Record], report: Report) -> list[_Job]:
        """The jobs of ``rows`` Redis lacks or holds at a lower version: one pipelined HGET
        of each job's packed fields (one round trip per node)."""
        pipe = self.redis.pipeline(transaction=False)
        for row in rows:
            pipe.hget(self.keys.job(row["id"]), "t")
        now_ms = int(time.time() * 1000)
        out = []
        for row, t in zip(rows, await pipe.execute(), strict=True):
            was, held = "", None
            if t is not None:
                # lib.lua packed_t: state version attempt updated run_at run_at_iso cancel
                # lease_version lv lt worker
                parts = (t.decode() if isinstance(t, bytes) else t).split(" ", 10)
                state, version = parts[0], parts[1]
                if int(version) >= row["version"]:
                    continue
                was = f"{state} {version}"
                if state == "running":
                    held = _Lease(parts[10], int(parts[2]), int(parts[7]))
            elif row["state"] in FINISHED and self._ttl(row, now_ms) <= 0:
                report.expired += 1
                continue
            if row["payload"] is None:
                report.incomplete += 1
                continue
            out.append(_Job(row, was, held))
        return out

    def _ttl(self, row: asyncpg.Record, now_ms: int) -> int:
        """Seconds a finished job has left in Redis (its retention from its finish)."""
        keep = self.settings.retention_seconds
        if row["state"] == "failed":
            keep = self.settings.dead_retention_seconds
        finished = _ms(_doc_decoder.decode(row["doc"]).updated_at)
        return keep - (now_ms - finished) // 1000

    async def _restore(self, conn: AnyConnection, jobs: Sequence[_Job], report: Report) -> None:
        """reconcile.lua for ``jobs``: one call per shard, all in one pipeline."""
        large, deps, dependents = await _extras(conn, jobs)
        flows = await _in_flows(conn, jobs)
        by_shard: dict[int, list[_Job]] = defaultdict(list)
        for job in jobs:
            by_shard[self.keys.shard_of(job.id)].append(job)
        now_ms = int(time.time() * 1000)
        calls: list[Call] = []
        order: list[list[_Job]] = []
        for shard, members in by_shard.items():
            args: list[Any] = [len(members)]
            for job in members:
                args += self._fields(job, now_ms, large, deps, dependents)
                args.append(self._idempotency(job, now_ms, flows))
            calls.append(("reconcile", shard, args))
            order.append(members)
        replies = await self.scripts.call_many(calls)
        for members, reply in zip(order, replies, strict=True):
            for i, job in enumerate(members):
                kind, was, now = (_text(v) for v in reply[3 * i : 3 * i + 3])
                if kind == "skipped":
                    report.skipped += 1
                    continue
                report.repaired[kind] += 1
                if self.on_repair is not None:
                    self.on_repair(kind)
                log.info(
                    "event=reconciled job=%s kind=%s from=%s to=%s",
                    job.id,
                    kind,
                    _said(was),
                    _said(now),
                )

    def _idempotency(self, job: _Job, now_ms: int, flows: set[str]) -> str:
        """reconcile.lua's 25th field: the job's idempotency record, '<request hash> <ms
        left>', made again as the submit made it (``validate.request_hash``), or '' when
        there is none to put back: no key, its time is up, or the hash cannot be made again
        (an encrypted payload, whose plain bytes it was made of; a job that waits for others,
        whose hash took in how, which Postgres does not keep)."""
        row = job.row
        key, payload = row["idempotency_key"], row["payload"]
        if not key or payload is None or job.id in flows:
            return ""
        data = payload.encode() if isinstance(payload, str) else bytes(payload)
        if data.startswith(PREFIX):
            return ""
        created = _ms(_doc_decoder.decode(row["doc"]).created_at)
        left = created + self.settings.idempotency_ttl_seconds * 1000 - now_ms
        if left <= 0:
            return ""
        return f"{request_hash_of(row['type'], data)} {left}"

    def _fields(
        self,
        job: _Job,
        now_ms: int,
        large: dict[str, bytes],
        deps: dict[str, list[tuple[str, bool]]],
        dependents: dict[str, list[str]],
    ) -> list[Any]:
        """reconcile.lua's first 24 fields of one job."""
        row = job.row
        doc = _doc_decoder.decode(row["doc"])
        state = row["state"]
        ttl = self.settings.retention_seconds
        if state in FINISHED:
            ttl = max(1, self._ttl(row, now_ms))
        waits = deps.get(job.id, []) if state == "waiting" else []
        return [
            job.id,
            row["tenant"],
            row["type"],
            row["priority"],
            row["max_attempts"],
            doc.created_at,
            row["queue"],
            state,
            row["version"],
            row["attempt"],
            _ms(doc.updated_at),
            "" if doc.run_at is None else _ms(doc.run_at),
            1 if doc.cancel_requested else 0,
            doc.worker or "",
            _raw(doc.error),
            _raw(doc.progress),
            row["payload"],
            row["idempotency_key"] or "",
            _result(row, large) if state == "succeeded" else b"",
            ttl,
            " ".join(dep for dep, _ in waits),
            "".join("1" if child else "0" for _, child in waits),
            " ".join(dependents.get(job.id, [])) if state in FINISHED else "",
            "" if job.claimed is None else job.claimed,
        ]


def _result(row: asyncpg.Record, large: dict[str, bytes]) -> bytes:
    """A success's result as Redis keeps it: inline JSON, '@<ref>' for one kept in the result
    store, b'' for none (a null result is the field's absence)."""
    if row["result_ref"] is not None:
        return RESULT_REF + str(row["result_ref"]).encode()
    result = row["result"]
    if result is None and row["result_size"] is not None:
        result = large.get(row["id"])
    if result is None or bytes(result) == b"null":
        return b""
    return bytes(result)


async def _extras(
    conn: AnyConnection, jobs: Sequence[_Job]
) -> tuple[dict[str, bytes], dict[str, list[tuple[str, bool]]], dict[str, list[str]]]:
    """What the job rows do not hold, for the jobs that need it: large results, the
    dependencies of waiting jobs, the dependents of finished ones."""
    large_ids = [
        j.id
        for j in jobs
        if j.row["state"] == "succeeded"
        and j.row["result"] is None
        and j.row["result_ref"] is None
        and j.row["result_size"] is not None
    ]
    waiting = [j.id for j in jobs if j.row["state"] == "waiting"]
    finished = [j.id for j in jobs if j.row["state"] in FINISHED]
    large: dict[str, bytes] = {}
    if large_ids:
        large = {
            r["job_id"]: bytes(r["result"]) for r in await conn.fetch(_LARGE_RESULTS, large_ids)
        }
    deps: dict[str, list[tuple[str, bool]]] = defaultdict(list)
    if waiting:
        for r in await conn.fetch(_DEPENDENCIES, waiting):
            deps[r["job_id"]].append((r["depends_on"], r["child"]))
    dependents: dict[str, list[str]] = defaultdict(list)
    if finished:
        for r in await conn.fetch(_DEPENDENTS, finished):
            dependents[r["depends_on"]].append(r["job_id"])
    return large, deps, dependents


async def _in_flows(conn: AnyConnection, jobs: Sequence[_Job]) -> set[str]:
    """Of the jobs with an idempotency key, those that wait for others (their key's hash
    took in what they wait for)."""
    keyed = [j.id for j in jobs if j.row["idempotency_key"]]
    if not keyed:
        return set()
    return {r["job_id"] for r in await conn.fetch(_WAITING_FOR, keyed)}


async def _claims(conn: AnyConnection, jobs: Sequence[_Job]) -> None:
    """Each job running in Postgres and in Redis is given the version of its latest claim
    in Postgres's history (None when pruned from it: then its worker and attempt decide)."""
    running = {j.id: j for j in jobs if j.row["state"] == "running" and j.held is not None}
    if running:
        for r in await conn.fetch(_CLAIMS, list(running)):
            running[r["job_id"]].claimed = int(r["version"])


async def _batches(
    conn: AnyConnection, sql: str, size: int, *args: Any
) -> AsyncIterator[list[asyncpg.Record]]:
    """The rows of ``sql``, ``size`` at a time, from one cursor (one scan)."""
    async with conn.transaction(readonly=True):
        cursor = await conn.cursor(sql, *args)
        while rows := await cursor.fetch(size):
            yield rows


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _said(state_version: str) -> str:
    """'<state> <version>' as a log value, 'absent' for ''."""
    return state_version.replace(" ", ":") if state_version else "absent"


async def reconcile(
    settings: Settings,
    redis: RedisClient,
    conn: AnyConnection,
    since: float,
    *,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
    on_repair: Callable[[str], None] | None = None,
    live_shards: frozenset[int] = frozenset(),
) -> Report:
    """One pass (see the module's docstring); its summary is logged."""
    reconciler = Reconciler(settings, redis, batch_size=batch_size, on_repair=on_repair)
    report = await reconciler.run(conn, since, dry_run=dry_run, live_shards=live_shards)
    log.info(
        "event=reconcile_done dry_run=%d checked=%d restored=%d advanced=%d requeued=%d "
        "expired=%d skipped=%d seconds=%.2f",
        dry_run,
        report.checked,
        report.repaired["restored"],
        report.repaired["advanced"],
        report.repaired["requeued"],
        report.expired,
        report.skipped,
        report.seconds,
    )
    return report


async def run_ids(redis: RedisClient) -> frozenset[str]:
    """The run id of every Redis primary: one that was not there before is a server that
    started since (a promoted replica, a restart), which may lack acknowledged writes."""
    return frozenset(
        str(node.get("run_id", "")) for node in await info_of_primaries(redis, "server")
    )


async def run_reconciling(
    settings: Settings,
    redis: RedisClient,
    stop: asyncio.Event,
    on_repair: Callable[[str], None] | None = None,
) -> None:
    """Every ``reconcile_seconds``, the primaries' run ids; when one is new, a pass over the
    last ``reconcile_window_seconds`` at once and another ``SETTLE_SECONDS`` later (the
    first look only remembers them: a persister starting is no sign of a failover). The
    second pass catches the transitions that reached Postgres after the first: batches read
    from the old primary and committed late, by this persister or another. A pass that fails
    is tried again at the next look, until one completes.

    A new primary that lost its data (``data_lost``): the passes also take in every job of
    its shards not finished, however long ago it last moved (outside the window, as lost)."""
    every = settings.reconcile_seconds
    if every <= 0:
        return
    known: frozenset[str] | None = None
    due: list[float] = []  # when the passes still to run are due (monotonic)
    emptied: frozenset[int] = frozenset()  # shards whose every live job they take in
    while not stop.is_set():
        try:
            seen = await run_ids(redis)
            if known is not None and not seen <= known:
                log.warning(
                    "event=redis_primary_changed new_run_ids=%s", ",".join(sorted(seen - known))
                )
                emptied |= await data_lost(settings, redis)  # until a pass has put them back
                now = time.monotonic()
                due = [now, now + SETTLE_SECONDS]
            known = seen if known is None else known | seen
            if due and time.monotonic() >= due[0]:
                # a connection of its own, as pruning's: the pool's serve the write-behind
                window = settings.reconcile_window_seconds
                await reconcile_once(
                    settings, redis, window, on_repair, live_shards=emptied, mark=True
                )
                due.pop(0)
                emptied = emptied if due else frozenset()
        except _PASS_FAILED as exc:
            log.warning("event=reconcile_failed retry_in=%.1fs error=%r", every, exc)
        except Exception:  # a bug: its stack logged, and the schedule goes on
            log.exception("event=reconcile_failed retry_in=%.1fs", every)
        await wait_for(stop, every)


async def data_lost(settings: Settings, redis: RedisClient) -> frozenset[int]:
    """The shards of a Redis that lost its data (restarted without it): those without the
    format mark every process sets as it starts."""
    emptied = await job_format.unmarked(redis, Keys(settings.prefix, settings.shards))
    if emptied:
        log.warning(
            "event=redis_data_lost shards=%s: every job of theirs not finished is compared",
            job_format.shard_list(emptied).split(" ", 1)[1].replace(", ", ","),
        )
    return frozenset(emptied)


async def reconcile_once(
    settings: Settings,
    redis: RedisClient,
    since: float,
    on_repair: Callable[[str], None] | None = None,
    *,
    dry_run: bool = False,
    live_shards: frozenset[int] | None = None,
    mark: bool = False,
) -> Report:
    """A pass on a connection of its own; ``live_shards`` None (``jobtier reconcile``): found
    (``data_lost``). ``mark`` (a persister's, whose deployment was format 3 as it started):
    once the pass is done, they are marked format 3 again, or a process started now would
    refuse what was written since as an older format."""
    conn: Connection = await connect(settings.database_url, timeout=10)
    try:
        if live_shards is None:
            live_shards = await data_lost(settings, redis)
        kw: dict[str, Any] = {"dry_run": dry_run, "on_repair": on_repair}
        report = await reconcile(settings, redis, conn, since, live_shards=live_shards, **kw)
    finally:
        await close(conn)
    report.unmarked = tuple(sorted(live_shards))
    if mark and live_shards and not dry_run:
        await job_format.mark(redis, Keys(settings.prefix, settings.shards), sorted(live_shards))
        log.warning("event=job_format_marked_again shards=%s", ",".join(map(str, live_shards)))
    return report
