"""The engine's Python API: submit, status, cancel, replay and queue statistics.

``Queue`` owns one Redis client and the scripts; the HTTP API, the worker, the scheduler and
in-process producers all go through it. Input is validated here, before anything is sent:
a bad request raises ``InvalidRequest`` (or ``UnknownTask``) and changes nothing.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec

from jobtier.config import Settings
from jobtier.connection import RedisClient, check_redis, connect
from jobtier.errors import (
    Code,
    IdempotencyConflict,
    InvalidRequest,
    JobNotFound,
    PayloadTooLarge,
    TransitionRefused,
    UnknownTask,
)
from jobtier.keys import Keys
from jobtier.model import PRIORITIES, JobSpec, JobStatus, Priority, decode_status, encode_json
from jobtier.scripts import Scripts, SubmitItem, SubmitOutcome
from jobtier.worker.registry import TASK_NAME_RE, Task, TaskRegistry

TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
IDEMPOTENCY_KEY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")  # printable ASCII, no spaces
MAX_ATTEMPTS_LIMIT = 100
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Submitted:
    """The outcome of a submit: the job's status document, and whether this call created it."""

    job_id: str
    doc: bytes
    created: bool

    @property
    def status(self) -> JobStatus:
        return decode_status(self.doc)


class Queue:
    """Producer and admin access to one jobtier deployment.

    >>> queue = await Queue.connect(Settings.from_env())
    >>> job = await queue.submit("resize", {"image": "a.png"}, priority="high")
    """

    def __init__(
        self,
        settings: Settings,
        redis: RedisClient,
        registry: TaskRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.prefix, settings.shards)
        self.scripts = Scripts(redis, self.keys)
        self.registry = registry

    @classmethod
    async def connect(
        cls, settings: Settings, registry: TaskRegistry | None = None, *, check: bool = True
    ) -> Queue:
        """Connect, check that Redis is fit (non-evicting, AOF) and load the scripts."""
        queue = cls(settings, connect(settings), registry)
        try:
            if check:
                await check_redis(queue.redis, settings)
            await queue.scripts.load()
        except BaseException:
            await queue.close()
            raise
        return queue

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- submit ---------------------------------------------------------------------------
    async def submit(
        self,
        type: str | Task,
        payload: Any = None,
        *,
        priority: str = Priority.NORMAL,
        run_at: datetime | float | None = None,
        delay: float | None = None,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> Submitted:
        """Submit one job. A repeated ``idempotency_key`` with the same type and payload
        returns the original job (``created`` False); with a different one it raises
        ``IdempotencyConflict``."""
        if isinstance(type, Task):
            type = type.name
        when: datetime | None
        if isinstance(run_at, bool):
            raise InvalidRequest("run_at must be a datetime or a Unix time", field="run_at")
        if isinstance(run_at, int | float):
            when = datetime.fromtimestamp(run_at).astimezone()
        else:
            when = run_at
        spec = JobSpec(
            type=type,
            payload=payload,
            priority=priority,  # type: ignore[arg-type]  # validated by prepare()
            run_at=when,
            delay=delay,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
        )
        (result,) = await self.submit_many([spec], tenant=tenant)
        if isinstance(result, Exception):
            raise result
        return result

    async def submit_many(
        self, specs: Sequence[JobSpec], *, tenant: str = DEFAULT_TENANT
    ) -> list[Submitted | IdempotencyConflict]:
        """Submit jobs in one round trip per Redis node (one script call per shard).

        Every spec is validated first: one bad spec raises ``InvalidRequest`` (naming its
        index) and nothing is submitted. Idempotency conflicts are returned in place.
        """
        if len(specs) > self.settings.max_batch:
            raise InvalidRequest(f"at most {self.settings.max_batch} jobs per batch", field="jobs")
        items = []
        for index, spec in enumerate(specs):
            try:
                items.append(self.prepare(spec, tenant))
            except InvalidRequest as exc:
                if len(specs) > 1:
                    raise type(exc)(f"jobs[{index}]: {exc}", field=exc.field) from None
                raise
        return await self.submit_many_prepared(items)

    async def submit_many_prepared(
        self, items: Sequence[SubmitItem]
    ) -> list[Submitted | IdempotencyConflict]:
        """Submit jobs already validated by ``prepare``."""
        outcomes = await self.submit_items(items)
        results: list[Submitted | IdempotencyConflict] = []
        for item, outcome in zip(items, outcomes, strict=True):
            if outcome.code is Code.IDEMPOTENCY_CONFLICT:
                results.append(IdempotencyConflict(item.idempotency_key, outcome.job_id))
            else:
                created = outcome.code is Code.OK
                results.append(Submitted(outcome.job_id, outcome.doc, created))
        return results

    def prepare(self, spec: JobSpec, tenant: str, job_id: str | None = None) -> SubmitItem:
        """Validate one job and turn it into the submit script's arguments."""
        s = self.settings
        if not TENANT_RE.fullmatch(tenant):
            raise InvalidRequest(f"tenant {tenant[:70]!r} must match {TENANT_RE.pattern}")
        if not isinstance(spec.type, str) or not TASK_NAME_RE.fullmatch(spec.type):
            raise InvalidRequest(
                f"type {str(spec.type)[:140]!r} must match {TASK_NAME_RE.pattern}", field="type"
            )
        task = None
        if self.registry is not None:
            task = self.registry.get(spec.type)
            if task is None:
                known = ", ".join(self.registry.names()[:20])
                raise UnknownTask(f"unknown task {spec.type!r} (known: {known})", field="type")
        if spec.priority not in PRIORITIES:
            raise InvalidRequest(
                f"priority {str(spec.priority)[:40]!r} is not one of {', '.join(PRIORITIES)}",
                field="priority",
            )
        try:
            payload = encode_json(spec.payload)
        except TypeError as exc:
            raise InvalidRequest(f"payload: {exc}", field="payload") from None
        if len(payload) > s.max_payload_bytes:
            raise PayloadTooLarge(
                f"payload is {len(payload)} bytes; the limit is {s.max_payload_bytes} "
                "(JOBTIER_MAX_PAYLOAD_BYTES)",
                field="payload",
            )
        max_attempts = spec.max_attempts
        if max_attempts is None:
            max_attempts = task.max_attempts if task else s.default_max_attempts
        elif isinstance(max_attempts, bool) or not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise InvalidRequest(
                f"max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}", field="max_attempts"
            )
        run_at_ms, delay_ms = self._timing(spec)
        key = spec.idempotency_key or ""
        if spec.idempotency_key is not None and not IDEMPOTENCY_KEY_RE.fullmatch(key):
            raise InvalidRequest(
                "idempotency_key must be 1-200 printable ASCII characters without spaces",
                field="idempotency_key",
            )
        if job_id is None:
            shard = self.keys.shard_for(tenant, key) if key else None
            job_id = self.keys.new_id(shard)
        request_hash = hashlib.blake2b(
            spec.type.encode() + b"\x00" + payload, digest_size=16
        ).hexdigest()
        return SubmitItem(
            job_id, tenant, spec.type, spec.priority, payload, max_attempts,
            run_at_ms, delay_ms, key, request_hash,
        )  # fmt: skip

    def _timing(self, spec: JobSpec) -> tuple[int, int]:
        s = self.settings
        if spec.run_at is not None and spec.delay is not None:
            raise InvalidRequest("give run_at or delay, not both", field="run_at")
        if spec.delay is not None:
            delay = spec.delay
            if isinstance(delay, bool) or not math.isfinite(delay) or delay < 0:
                raise InvalidRequest(
                    "delay must be a non-negative number of seconds", field="delay"
                )
            if delay > s.max_future_seconds:
                raise InvalidRequest(
                    f"delay is more than {s.max_future_seconds} seconds", field="delay"
                )
            return 0, round(delay * 1000)
        if spec.run_at is not None:
            if spec.run_at.tzinfo is None:
                raise InvalidRequest("run_at needs a time zone (e.g. a trailing Z)", field="run_at")
            at = spec.run_at.timestamp()
            now = time.time()
            if at < now - s.past_tolerance_seconds:
                raise InvalidRequest(
                    f"run_at is more than {s.past_tolerance_seconds:g} s in the past",
                    field="run_at",
                )
            if at > now + s.max_future_seconds:
                raise InvalidRequest(
                    f"run_at is more than {s.max_future_seconds} s ahead", field="run_at"
                )
            return max(round(at * 1000), 1), 0
        return 0, 0

    async def submit_items(self, items: Sequence[SubmitItem]) -> list[SubmitOutcome]:
        """Run already-validated submits: one script call per shard, pipelined."""
        by_shard: dict[int, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_shard[self.keys.shard_of(item.job_id)].append(i)
        ttl = self.settings.idempotency_ttl_seconds * 1000
        calls = [
            self.scripts.submit_call(shard, [items[i] for i in idx], ttl)
            for shard, idx in by_shard.items()
        ]
        replies = await self.scripts.call_many(calls)
        outcomes: list[SubmitOutcome | None] = [None] * len(items)
        for idx, reply in zip(by_shard.values(), replies, strict=True):
            for i, outcome in zip(idx, self.scripts.parse_submit(reply), strict=True):
                outcomes[i] = outcome
        return [o for o in outcomes if o is not None]

    # --- reads ----------------------------------------------------------------------------
    def _check_id(self, job_id: str) -> None:
        if not self.keys.valid_id(job_id):
            raise JobNotFound(job_id)

    async def status_doc(self, job_id: str, tenant: str | None = None) -> bytes:
        """The status document as stored (bytes), or ``JobNotFound`` (also for another
        tenant's job)."""
        self._check_id(job_id)
        owner, doc = await self.redis.hmget(self.keys.job(job_id), "tenant", "doc")
        if doc is None or (tenant is not None and owner != tenant.encode()):
            raise JobNotFound(job_id)
        return doc if isinstance(doc, bytes) else str(doc).encode()

    async def status(self, job_id: str, tenant: str | None = None) -> JobStatus:
        return decode_status(await self.status_doc(job_id, tenant))

    async def result(self, job_id: str, tenant: str | None = None) -> tuple[JobStatus, Any]:
        """(status, result): the result is the task's return value once succeeded, else None."""
        self._check_id(job_id)
        owner, doc, result = await self.redis.hmget(
            self.keys.job(job_id), "tenant", "doc", "result"
        )
        if doc is None or (tenant is not None and owner != tenant.encode()):
            raise JobNotFound(job_id)
        return decode_status(doc), msgspec.json.decode(result) if result else None

    async def payload(self, job_id: str) -> Any:
        self._check_id(job_id)
        raw = await self.redis.hget(self.keys.job(job_id), "payload")
        if raw is None:
            raise JobNotFound(job_id)
        return msgspec.json.decode(raw)

    # --- changes --------------------------------------------------------------------------
    async def cancel(self, job_id: str, tenant: str | None = None) -> JobStatus:
        """Cancel a waiting job, or ask the worker running it to stop. Raises
        ``JobNotFound``, or ``TransitionRefused(WRONG_STATE)`` once it has finished."""
        return decode_status(await self.cancel_doc(job_id, tenant))

    async def cancel_doc(self, job_id: str, tenant: str | None = None) -> bytes:
        """``cancel``, returning the status document as stored."""
        self._check_id(job_id)
        code, doc = await self.scripts.cancel(
            self.keys.shard_of(job_id), tenant or "", job_id, self.settings.retention_seconds
        )
        if code is Code.NOT_FOUND:
            raise JobNotFound(job_id)
        if code is not Code.OK:
            raise TransitionRefused(code, job_id, "has already finished")
        return bytes(doc)

    async def replay(self, job_id: str, tenant: str | None = None) -> JobStatus:
        """Send a dead-lettered (failed) job back to its queue with its attempts reset."""
        return decode_status(await self.replay_doc(job_id, tenant))

    async def replay_doc(self, job_id: str, tenant: str | None = None) -> bytes:
        """``replay``, returning the status document as stored."""
        self._check_id(job_id)
        code, doc = await self.scripts.replay(self.keys.shard_of(job_id), tenant or "", job_id)
        if code is Code.NOT_FOUND:
            raise JobNotFound(job_id)
        if code is not Code.OK:
            raise TransitionRefused(code, job_id, "is not in the dead-letter set")
        return bytes(doc)

    async def dead_letters(self, limit: int = 100, *, type: str | None = None) -> list[JobStatus]:
        """The most recently dead-lettered jobs still held by Redis, newest first."""
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.zrevrange(self.keys.dead(shard), 0, limit - 1, withscores=True)
        entries = [
            (score, member.decode(), shard)
            for shard, rows in enumerate(await pipe.execute())
            for member, score in rows
        ]
        entries.sort(reverse=True)
        pipe = self.redis.pipeline(transaction=False)
        for _, job_id, shard in entries:
            pipe.hget(self.keys.job_in(shard, job_id), "doc")
        out = []
        for doc in await pipe.execute():
            if doc is None:  # expired from Redis (dead retention): Postgres still has it
                continue
            status = decode_status(doc)
            if type is None or status.type == type:
                out.append(status)
            if len(out) >= limit:
                break
        return out

    async def replay_many(self, *, type: str | None = None, limit: int = 1000) -> list[str]:
        """Replay dead-lettered jobs (optionally of one type); returns the ids replayed."""
        replayed = []
        for status in await self.dead_letters(limit, type=type):
            try:
                await self.replay(status.id)
            except (TransitionRefused, JobNotFound):
                continue  # replayed or expired meanwhile
            replayed.append(status.id)
        return replayed

    async def stats(self) -> dict[str, Any]:
        """Queue depth per priority, scheduled, running and dead counts, per shard and total."""
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            for p in PRIORITIES:
                pipe.llen(self.keys.queue(shard, p))
            pipe.zcard(self.keys.sched(shard))
            pipe.zcard(self.keys.active(shard))
            pipe.zcard(self.keys.dead(shard))
        values = await pipe.execute()
        width = len(PRIORITIES) + 3
        shards = []
        total: dict[str, int] = defaultdict(int)
        for shard in range(self.keys.shards):
            row = values[shard * width : (shard + 1) * width]
            entry = {
                "shard": shard,
                "queued": {p.value: n for p, n in zip(PRIORITIES, row[:4], strict=True)},
            }
            entry.update(scheduled=row[4], running=row[5], dead=row[6])
            shards.append(entry)
            for p, n in zip(PRIORITIES, row[:4], strict=True):
                total[f"queued_{p}"] += n
            total["scheduled"] += row[4]
            total["running"] += row[5]
            total["dead"] += row[6]
        total["queued"] = sum(total[f"queued_{p}"] for p in PRIORITIES)
        return {"total": dict(total), "shards": shards}

    async def waiting_by_tenant(self) -> dict[str, int]:
        """Queued + scheduled jobs per tenant, summed over shards."""
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.hgetall(self.keys.waiting(shard))
        out: dict[str, int] = defaultdict(int)
        for counts in await pipe.execute():
            for tenant, n in counts.items():
                out[tenant.decode()] += int(n)
        return dict(out)
