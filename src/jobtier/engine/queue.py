"""The engine's Python API: submit, status, cancel, replay and queue statistics.

``Queue`` owns one Redis client and the scripts; the HTTP API, the worker, the scheduler and
in-process producers all go through it. Input is validated here, before anything is sent:
a bad request raises ``InvalidRequest`` (or ``UnknownTask``) and changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import msgspec

from jobtier.config import Settings
from jobtier.core.errors import (
    Code,
    ConfigError,
    IdempotencyConflict,
    InvalidRequest,
    JobNotFound,
    PayloadTooLarge,
    TransitionRefused,
    UnknownTask,
)
from jobtier.core.keys import Keys
from jobtier.core.model import (
    DEFAULT_QUEUE,
    PRIORITIES,
    CallbackSpec,
    Dependency,
    FlowJob,
    FlowSubmitted,
    JobSpec,
    JobStatus,
    OnDependencyFailure,
    Priority,
    QueueLimits,
    Submitted,
    TaskInfo,
    TaskLookup,
    decode_status,
    encode_json,
)
from jobtier.core.names import IDEMPOTENCY_KEY_RE, QUEUE_NAME_RE, TASK_NAME_RE, TENANT_RE
from jobtier.flows import submit as flow_submit
from jobtier.flows.plan import plan_flow
from jobtier.flows.reads import compensation_of, dependencies
from jobtier.status.docs import read_doc, read_docs
from jobtier.store import format as job_format
from jobtier.store.redis import RedisClient, check_redis, connect
from jobtier.store.scripts import Scripts, SubmitItem, SubmitOutcome
from jobtier.worker.registry import Task

if TYPE_CHECKING:
    from jobtier.webhooks.callbacks import CallbackStore

_limits_decoder = msgspec.json.Decoder(QueueLimits)
MAX_ATTEMPTS_LIMIT = 100
MAX_CONCURRENCY_LIMIT = 10_000
WORKER_FRESH_SECONDS = 60.0  # a worker advertises itself every third of a lease (10 s)
WORKER_FORGET_SECONDS = 900.0  # the entry of a worker gone this long is deleted
SPREAD_FROM = 128  # jobs in a submit from which its shards go in several pipelines (submit_items)
DEFAULT_TENANT = "default"


PURGE_BATCH = 500  # jobs per purge.lua call: a few ms of Redis time


@dataclass(frozen=True, slots=True)
class Purged:
    """What ``Queue.purge`` did: jobs cancelled, and the queue's ready jobs left after it."""

    queue: str
    cancelled: int
    remaining: int


class Queue:
    """Producer and admin access to one jobtier deployment.

    >>> queue = await Queue.connect(Settings.from_env())
    >>> job = await queue.submit("resize", {"image": "a.png"}, priority="high")
    """

    def __init__(
        self,
        settings: Settings,
        redis: RedisClient,
        registry: TaskLookup | None = None,
        *,
        require_known: bool = True,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = Keys(settings.prefix, settings.shards)
        self.scripts = Scripts(redis, self.keys)
        # where submits find a task's queue, attempts and payload check: the tasks this
        # process imports (a TaskRegistry), or what the workers advertise (engine/catalog.py)
        self.registry = registry
        # the result store's opening, started by the first stored result read (stored_result)
        self._results: asyncio.Future[Any] | None = None
        self._callbacks: CallbackStore | None = None  # opened by the first flow with callbacks
        self.require_known = require_known  # refuse a type the registry does not know
        # tasks handed to submit() as Task objects (and their compensations): known here
        # even without a registry
        self._local: dict[str, TaskInfo] = {}
        # names found valid (_check_name), as (what, name)
        self._valid: set[tuple[str, str]] = set()

    @classmethod
    async def connect(
        cls, settings: Settings, registry: TaskLookup | None = None, *, check: bool = True
    ) -> Queue:
        """Connect, check that Redis is fit (non-evicting, AOF), load the scripts, and switch
        a Redis that holds no job yet to the newest job format (store/format.py)."""
        queue = cls(settings, connect(settings), registry)
        try:
            if check:
                await check_redis(queue.redis, settings)
            await queue.scripts.load()
            await job_format.adopt(queue.redis, queue.keys)
        except BaseException:
            await queue.close()
            raise
        return queue

    async def close(self) -> None:
        opening, self._results = self._results, None
        if opening is not None:
            if not opening.done():
                opening.cancel()
            elif not opening.cancelled() and opening.exception() is None:
                await opening.result().close()  # (one that failed to open has nothing to close)
        if self._callbacks is not None:
            await self._callbacks.pool.close()
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
        queue: str | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        depends_on: Sequence[str] | None = None,
        on_dependency_failure: OnDependencyFailure | None = None,
        callback: CallbackSpec | str | None = None,
    ) -> Submitted:
        """Submit one job. A repeated ``idempotency_key`` with the same type and payload
        returns the original job (``created`` False); with a different one it raises
        ``IdempotencyConflict``. Given a ``Task``, its queue and attempts are the defaults.
        ``depends_on``: ids of jobs it waits for (see ``JobSpec``). ``callback``: the job's
        own webhook (a URL alone: its terminal state), written to Postgres as ``submit_many``
        says."""
        if isinstance(type, Task):
            self.know(type)
            if queue is None:
                queue = type.queue
            if max_attempts is None:
                max_attempts = type.max_attempts
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
            queue=queue,
            concurrency_key=concurrency_key,
            concurrency_limit=concurrency_limit,
            depends_on=list(depends_on) if depends_on is not None else None,
            on_dependency_failure=on_dependency_failure,
            callback=CallbackSpec(url=callback) if isinstance(callback, str) else callback,
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

        A spec's ``callback`` is written to Postgres (``JOBTIER_DATABASE_URL``, connected on
        first use) before the submit, as the API writes one, and the dispatcher delivers it
        (``webhooks/callbacks.py``). A refused URL is an ``InvalidRequest`` naming
        ``jobs[i].callback.url`` (``callback.url`` for one spec), a tenant without a signing
        secret a ``SecretMissing``, an empty ``JOBTIER_DATABASE_URL`` a ``ConfigError``:
        nothing is submitted or written.
        """
        if len(specs) > self.settings.max_batch:
            raise InvalidRequest(f"at most {self.settings.max_batch} jobs per batch", field="jobs")
        await self.ensure_known(spec.type for spec in specs)
        items = []
        for index, spec in enumerate(specs):
            try:
                items.append(self.prepare(spec, tenant))
            except InvalidRequest as exc:
                if len(specs) > 1:
                    raise type(exc)(f"jobs[{index}]: {exc}", field=exc.field) from None
                raise
        callbacks = [spec.callback for spec in specs]
        if all(cb is None for cb in callbacks):
            return await self.submit_many_prepared(items)
        from jobtier.webhooks.callbacks import submit_with_callbacks  # only with a callback

        store = await self._callback_store()
        return await submit_with_callbacks(self, items, callbacks, store, batch=len(items) > 1)

    async def submit_many_prepared(
        self, items: Sequence[SubmitItem], *, batch: bool | None = None
    ) -> list[Submitted | IdempotencyConflict]:
        """Submit jobs already validated by ``prepare``. The jobs their ``depends_on`` names
        must be the tenant's and held in Redis (else ``InvalidRequest`` naming
        ``jobs[i].depends_on``, or ``depends_on`` when not ``batch``; nothing submitted); the
        new dependents are linked to them before this returns (flows/submit.py)."""
        if batch is None:
            batch = len(items) > 1
        wanted = [
            (f"jobs[{i}].depends_on" if batch else "depends_on", dep)
            for i, item in enumerate(items)
            for dep in item.depends_on
        ]
        if wanted:
            await flow_submit.check_dependencies(self, wanted, items[0].tenant)
        outcomes = await self.submit_items(items)
        results: list[Submitted | IdempotencyConflict] = []
        dependents = []
        for item, outcome in zip(items, outcomes, strict=True):
            if outcome.code is Code.IDEMPOTENCY_CONFLICT:
                results.append(IdempotencyConflict(item.idempotency_key, outcome.job_id))
            else:
                created = outcome.code is Code.OK
                results.append(Submitted(outcome.job_id, outcome.doc, created))
                if item.depends_on:  # a duplicate too: its submit may have been cut short
                    dependents.append((outcome.job_id, item.depends_on))
        if dependents:
            await flow_submit.settle(self, items[0].tenant, dependents)
        return results

    # --- flows ------------------------------------------------------------------------------
    async def submit_flow(
        self,
        jobs: Sequence[FlowJob],
        *,
        tenant: str = DEFAULT_TENANT,
        idempotency_key: str | None = None,
    ) -> FlowSubmitted:
        """Submit a flow: jobs that wait for others of the flow (``after``, by ``ref``) or
        for existing jobs (``depends_on``). A job runs once everything it waits for has
        succeeded, and its task finds their results in ``ctx.dependencies``. Build chains and
        fan-ins with ``jobtier.flows.chain`` and ``fan_in``.

        ``InvalidRequest`` (nothing submitted) for a cycle, an unknown ref or id, a flow over
        ``JOBTIER_MAX_FLOW_JOBS``, or a job that does not validate. A repeated
        ``idempotency_key`` with the same jobs returns the flow it made (``created`` False),
        finishing its submit if that was cut short; with other jobs, ``IdempotencyConflict``.

        A job's ``callback`` is written to Postgres (``JOBTIER_DATABASE_URL``, connected on
        first use) before the submit, as the API writes a plain submit's; the dispatcher
        delivers it. A refused URL is an ``InvalidRequest`` naming ``jobs[i].callback.url``,
        a tenant without a signing secret a ``SecretMissing``: nothing is submitted or
        written.
        """
        prepared = await self.prepare_flow(jobs, tenant, idempotency_key)
        if not any(prepared.callbacks):
            return await flow_submit.submit_flow(self, prepared)
        store = await self._callback_store()
        return await flow_submit.submit_flow_with_callbacks(self, prepared, store)

    async def submit_flow_prepared(self, prepared: flow_submit.PreparedFlow) -> FlowSubmitted:
        """Submit a flow checked by ``prepare_flow`` (its jobs' callbacks apart: the API
        writes them, ``flow_submit.submit_flow_with_callbacks``)."""
        return await flow_submit.submit_flow(self, prepared)

    async def _callback_store(self) -> CallbackStore:
        """The jobs' callbacks in Postgres, for the jobs and flows this process submits."""
        from jobtier.persist.db import create_pool
        from jobtier.webhooks.callbacks import CallbackStore  # only if a callback is given
        from jobtier.webhooks.safety import AddressPolicy

        if not self.settings.database_url:
            # dropping the callback would submit a job whose webhook never comes
            raise ConfigError(
                "a job's callback is written to Postgres and JOBTIER_DATABASE_URL is empty: "
                "set it to the deployment's Postgres (the one its dispatcher reads), or "
                "submit without callback"
            )
        if self._callbacks is None:
            pool = await create_pool(self.settings.database_url, min_size=0, max_size=2)
            policy = AddressPolicy(self.settings.webhook_allowed_hosts)
            self._callbacks = CallbackStore(pool, self.redis, self.keys, policy)
        return self._callbacks

    async def prepare_flow(
        self, jobs: Sequence[FlowJob], tenant: str, idempotency_key: str | None = None
    ) -> flow_submit.PreparedFlow:
        """Check a flow (``submit_flow``) and prepare its jobs; nothing is sent."""
        key = idempotency_key or ""
        if idempotency_key is not None and not IDEMPOTENCY_KEY_RE.fullmatch(key):
            raise InvalidRequest(
                "idempotency_key must be 1-200 printable ASCII characters without spaces",
                field="idempotency_key",
            )
        plan = plan_flow(jobs, self.keys, self.settings.max_flow_jobs)
        await self.ensure_known(job.type for job in jobs)
        items = []
        for node in plan.nodes:
            spec = node.spec
            if key and node.index == plan.head:  # its shard holds the idempotency record
                spec = msgspec.structs.replace(spec, idempotency_key=key)
            try:
                items.append(self.prepare(spec, tenant))
            except InvalidRequest as exc:
                field = f"jobs[{node.index}].{exc.field}" if exc.field else f"jobs[{node.index}]"
                raise type(exc)(f"jobs[{node.index}]: {exc}", field=field) from None
        await flow_submit.check_dependencies(
            self,
            [(f"jobs[{n.index}].depends_on", dep) for n in plan.nodes for dep in n.depends_on],
            tenant,
        )
        callbacks = tuple(job.callback for job in jobs)
        return flow_submit.PreparedFlow(plan, items, tenant, key, callbacks)

    async def dependencies(self, job_id: str, tenant: str | None = None) -> list[Dependency]:
        """A job's dependencies, in order, with their state (and result or error once they
        finished). ``JobNotFound`` for a job Redis does not hold (or another tenant's)."""
        self._check_id(job_id)
        return await dependencies(self, job_id, tenant)

    async def compensation_of(self, job_id: str) -> str | None:
        """The id of the compensation job created when ``job_id`` failed for good (its
        task's ``on_failure``), or None."""
        self._check_id(job_id)
        return await compensation_of(self, job_id)

    def know(self, task: Task) -> None:
        """Know ``task`` (and its compensation task) without a registry: submits of its type
        get its queue, attempts and compensation."""
        self._local[task.name] = task.info()
        if task.compensation is not None:
            self._local[task.compensation.name] = task.compensation.info()

    def _task_info(self, type: str) -> TaskInfo | None:
        info = self.registry.info(type) if self.registry is not None else None
        return info if info is not None else self._local.get(type)

    async def ensure_known(self, types: Iterable[Any]) -> None:
        """Before ``prepare``: let the catalogue (engine/catalog.py) look again for types it does not
        know yet (a worker that just started). A no-op for an in-process TaskRegistry."""
        ensure = getattr(self.registry, "ensure", None)
        if ensure is not None:
            await ensure({t for t in types if isinstance(t, str)})

    async def task_defaults(
        self, type: str, queue: str | None, max_attempts: int | None, payload: Any = None
    ) -> tuple[str, int]:
        """(queue, attempts) for jobs of ``type`` (a schedule's): those given, else the task's,
        else the defaults; ``InvalidRequest`` for a type the registry does not know (when it
        must) or a payload that does not fit the task's."""
        await self.ensure_known((type,))
        item = self.prepare(
            JobSpec(type=type, payload=payload, queue=queue, max_attempts=max_attempts),
            DEFAULT_TENANT,
        )
        return item.queue, item.max_attempts

    def prepare(self, spec: JobSpec, tenant: str, job_id: str | None = None) -> SubmitItem:
        """Validate one job and turn it into the submit script's arguments."""
        s = self.settings
        self._check_name("tenant", tenant, TENANT_RE, 70, None)
        self._check_name("type", spec.type, TASK_NAME_RE, 140, "type")
        task = self._task_info(spec.type)
        if task is None and self.registry is not None and self.require_known:
            names = self.registry.names()
            known = ", ".join(names[:20]) + (", …" if len(names) > 20 else "") or "none"
            raise UnknownTask(
                f"no worker runs task {spec.type!r} (known: {known}); start a worker that has "
                "it, or set JOBTIER_REQUIRE_KNOWN_TYPES=0 to accept jobs before their workers",
                field="type",
            )
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
        if task is not None:
            task.validate(spec.payload)  # its annotated payload type, when it has one
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
        queue = spec.queue
        if queue is None:
            queue = task.queue if task else DEFAULT_QUEUE
        else:
            self._check_queue(queue)
        ckey, climit = self._concurrency(spec)
        if job_id is None:
            # A job with a concurrency key lives in the key's shard: the key's count and its
            # waiting jobs must be in the one shard its scripts touch. Its idempotency record
            # lives there too (with both, the idempotency key is scoped to the concurrency key).
            if ckey:
                shard: int | None = self.keys.shard_for(tenant, "\x01ck", ckey)
            else:
                shard = self.keys.shard_for(tenant, key) if key else None
            job_id = self.keys.new_id(shard)
        deps = self._depends_on(spec)
        # what tells "the same request" apart for an idempotency key (submit.lua compares it
        # only for a job given one: without a key, none is made or sent)
        request_hash = ""
        if key:
            material = spec.type.encode() + b"\x00" + payload
            if deps:  # the same request waits for the same jobs
                odf = spec.on_dependency_failure or "cancel"
                material += f"\x00{' '.join(deps)}\x00{odf}".encode()
            request_hash = hashlib.blake2b(material, digest_size=16).hexdigest()
        compensation = ""
        if task is not None and task.on_failure:
            comp = self._task_info(task.on_failure)
            compensation = (
                f"{task.on_failure} {comp.queue if comp else DEFAULT_QUEUE} "
                f"{comp.max_attempts if comp else s.default_max_attempts}"
            )
        flow = flow_submit.flow_blob(
            compensation=compensation,
            deps=deps,
            run_on_failure=spec.on_dependency_failure == "run",
            link_ms=round(s.flow_link_timeout_seconds * 1000),
        )
        return SubmitItem(
            job_id, tenant, spec.type, spec.priority, payload, max_attempts,
            run_at_ms, delay_ms, key, request_hash, queue, ckey, climit, flow,
            compensation, tuple(deps),
        )  # fmt: skip

    def _check_name(
        self, what: str, name: Any, pattern: re.Pattern[str], shown: int, field: str | None
    ) -> None:
        """InvalidRequest unless ``name`` is a str that matches ``pattern``. A name found valid
        is kept (bounded: names can be made per request, a tenant per user): a batch repeats
        a few, and a regex per job per name cost ~0.25 us of a submit's ~10 in the producer."""
        if isinstance(name, str) and (what, name) in self._valid:
            return
        if not isinstance(name, str) or not pattern.fullmatch(name):
            raise InvalidRequest(
                f"{what} {str(name)[:shown]!r} must match {pattern.pattern}", field=field
            )
        if len(self._valid) >= 4096:
            self._valid.clear()
        self._valid.add((what, name))

    def _depends_on(self, spec: JobSpec) -> list[str]:
        if spec.on_dependency_failure not in (None, "cancel", "run"):
            raise InvalidRequest(
                "on_dependency_failure must be cancel or run", field="on_dependency_failure"
            )
        if spec.depends_on is None:
            return []
        if not isinstance(spec.depends_on, list):
            raise InvalidRequest("depends_on must be a list of job ids", field="depends_on")
        deps = list(dict.fromkeys(spec.depends_on))
        for dep in deps:
            if not isinstance(dep, str) or not self.keys.valid_id(dep):
                raise InvalidRequest(
                    f"depends_on names {str(dep)[:70]!r}, which is not a job id",
                    field="depends_on",
                )
        limit = self.settings.max_flow_jobs
        if len(deps) > limit:
            raise InvalidRequest(
                f"a job waits for at most {limit} others (JOBTIER_MAX_FLOW_JOBS)",
                field="depends_on",
            )
        return deps

    @staticmethod
    def _concurrency(spec: JobSpec) -> tuple[str, int]:
        key, limit = spec.concurrency_key, spec.concurrency_limit
        if limit is not None and (
            isinstance(limit, bool) or not 1 <= limit <= MAX_CONCURRENCY_LIMIT
        ):
            raise InvalidRequest(
                f"concurrency_limit must be between 1 and {MAX_CONCURRENCY_LIMIT}",
                field="concurrency_limit",
            )
        if key is None:
            return "", 1  # a concurrency_limit without a key has nothing to limit
        if not isinstance(key, str) or not IDEMPOTENCY_KEY_RE.fullmatch(key):
            raise InvalidRequest(
                "concurrency_key must be 1-200 printable ASCII characters without spaces",
                field="concurrency_key",
            )
        return key, 1 if limit is None else limit

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
        # a large batch's shards in four pipelines sent in turn: Redis runs the first while
        # the others are packed (Scripts.call_spread); a small batch goes in one
        per = -(-len(calls) // 4) if len(items) >= SPREAD_FROM else len(calls)
        replies = await self.scripts.call_spread(calls, per)
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
        owner, doc = await read_doc(self.redis, self.keys, job_id)
        if doc is None or (tenant is not None and owner != tenant.encode()):
            raise JobNotFound(job_id)
        return doc if isinstance(doc, bytes) else str(doc).encode()

    async def status(self, job_id: str, tenant: str | None = None) -> JobStatus:
        return decode_status(await self.status_doc(job_id, tenant))

    async def result(self, job_id: str, tenant: str | None = None) -> tuple[JobStatus, Any]:
        """(status, result): the result is the task's return value once succeeded, else None."""
        self._check_id(job_id)
        owner, doc, result = await read_doc(self.redis, self.keys, job_id, "result")
        if doc is None or (tenant is not None and owner != tenant.encode()):
            raise JobNotFound(job_id)
        if isinstance(result, bytes) and result[:1] == b"@":  # kept in the result store
            result = await self.stored_result(result[1:].decode())  # (persist/results.py)
        return decode_status(doc), msgspec.json.decode(result) if result else None

    async def result_raw(self, job_id: str, tenant: str | None = None) -> tuple[JobStatus, bytes]:
        """(status, the result's JSON as stored: b"" for none); for a result kept in the
        result store, b"" too, and the status's ``result_url`` says where it is."""
        self._check_id(job_id)
        owner, doc, result = await read_doc(self.redis, self.keys, job_id, "result")
        if doc is None or (tenant is not None and owner != tenant.encode()):
            raise JobNotFound(job_id)
        raw = result if isinstance(result, bytes) and result[:1] != b"@" else b""
        return decode_status(doc), raw

    async def stored_result(self, ref: str) -> bytes | None:
        """A result kept in the result store, by its reference (persist/results.py; None when
        the store no longer holds it), read through a store opened on JOBTIER_DATABASE_URL at
        the first read and kept until ``close``: reads at once wait for one opening, and one
        that failed is tried again at the next read. ``Queue.result`` reads a job's so, and a
        worker its tasks' dependencies' (``JobContext.result``)."""
        from jobtier.persist.results import PostgresResultStore  # only if results are stored

        if not self.settings.database_url:
            raise ConfigError("a result in the result store: reading it needs JOBTIER_DATABASE_URL")
        opening = self._results
        if opening is None or (
            opening.done() and (opening.cancelled() or opening.exception() is not None)
        ):
            opening = asyncio.ensure_future(PostgresResultStore.connect(self.settings.database_url))
            self._results = opening
        # shielded: a reader cancelled while it waits leaves the opening to the others
        store = await asyncio.shield(opening)
        data: bytes | None = await store.get(ref)
        return data

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

    async def dead_letters(
        self,
        limit: int = 100,
        *,
        type: str | None = None,
        since: datetime | None = None,
        queue: str | None = None,
        tenant: str | None = None,
    ) -> list[JobStatus]:
        """The most recently dead-lettered jobs still held by Redis, newest first; only those
        of ``type``, ``queue`` and ``tenant``, dead-lettered at or after ``since``, when given.
        Each shard's set is read newest first, ``limit`` (at least 100) at a time, until enough
        match or none are left."""
        page = max(limit, 100)
        low: float | str = "-inf" if since is None else int(since.timestamp() * 1000)
        offsets = dict.fromkeys(range(self.keys.shards), 0)
        found: list[tuple[float, JobStatus]] = []
        while offsets and len(found) < limit:
            pipe = self.redis.pipeline(transaction=False)
            for shard, start in offsets.items():
                pipe.zrevrangebyscore(
                    self.keys.dead(shard), "+inf", low, start=start, num=page, withscores=True
                )
            entries = []
            for shard, rows in zip(list(offsets), await pipe.execute(), strict=True):
                entries += [(score, member.decode(), shard) for member, score in rows]
                if len(rows) < page:
                    del offsets[shard]  # read to the end
                else:
                    offsets[shard] += page
            entries.sort(reverse=True)
            docs = await read_docs(self.redis, self.keys, [job_id for _, job_id, _ in entries])
            for (score, _, _), (owner, doc) in zip(entries, docs, strict=True):
                if doc is None:  # expired from Redis (dead retention): Postgres still has it
                    continue
                status = decode_status(doc)
                if (
                    (type is None or status.type == type)
                    and (queue is None or status.queue == queue)
                    and (tenant is None or owner == tenant.encode())
                ):
                    found.append((score, status))
        found.sort(key=lambda item: -item[0])
        return [status for _, status in found[:limit]]

    async def replay_many(
        self,
        *,
        type: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
        queue: str | None = None,
        tenant: str | None = None,
    ) -> list[str]:
        """Replay dead-lettered jobs (optionally only those of a type, queue or tenant,
        dead-lettered since a time); returns the ids replayed."""
        replayed = []
        for status in await self.dead_letters(
            limit, type=type, since=since, queue=queue, tenant=tenant
        ):
            try:
                await self.replay(status.id)
            except (TransitionRefused, JobNotFound):
                continue  # replayed or expired meanwhile
            replayed.append(status.id)
        return replayed

    async def dead_letter(self, job_id: str) -> tuple[bytes, bytes, list[bytes]]:
        """One dead-lettered job in full: (status document, payload JSON, log lines JSON);
        ``JobNotFound`` for a job Redis does not hold in its dead-letter set."""
        self._check_id(job_id)
        shard = self.keys.shard_of(job_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zscore(self.keys.dead(shard), job_id)
        pipe.lrange(self.keys.lines(job_id), 0, -1)
        # both reads at once: one round trip's wait, as when the document was an HMGET
        (score, lines), (_, doc, payload) = await asyncio.gather(
            pipe.execute(), read_doc(self.redis, self.keys, job_id, "payload")
        )
        if score is None or doc is None:
            raise JobNotFound(job_id)
        return doc, payload or b"null", lines

    async def log_lines(self, job_id: str) -> list[bytes]:
        """The job's log lines (``ctx.log``) still in Redis, oldest first, JSON each."""
        self._check_id(job_id)
        lines = await self.redis.lrange(self.keys.lines(job_id), 0, -1)
        return [line if isinstance(line, bytes) else line.encode() for line in lines]

    async def stats(self) -> dict[str, Any]:
        """Jobs by state, per shard, per queue and in total.

        ``total``: ``queued`` (and ``queued_<priority>``), ``parked`` (handed back by a worker
        that cannot run them), ``waiting`` (for their dependencies), ``scheduled``,
        ``running``, ``dead``. ``queues``: per queue, ready jobs by priority, ``parked``,
        ``waiting``, ``running`` and ``paused``. ``shards``: per shard, ready jobs by priority
        and the waiting, scheduled, running and dead counts.
        """
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.hgetall(self.keys.queue_counts(shard))
            pipe.hgetall(self.keys.parked(shard))
            pipe.zcard(self.keys.sched(shard))
            pipe.zcard(self.keys.active(shard))
            pipe.zcard(self.keys.dead(shard))
        values = await pipe.execute()
        total: dict[str, int] = defaultdict(int)
        queues: dict[str, dict[str, Any]] = {}

        def queue_entry(name: str) -> dict[str, Any]:
            entry = queues.get(name)
            if entry is None:
                entry = queues[name] = {
                    "queued": {p.value: 0 for p in PRIORITIES},
                    "parked": 0,
                    "waiting": 0,
                    "running": 0,
                    "paused": False,
                    "limited": False,
                    "blocked_until_ms": 0,
                }
            return entry

        shards = []
        for shard in range(self.keys.shards):
            counts, parked, scheduled, running, dead = values[shard * 5 : shard * 5 + 5]
            by_priority = {p.value: 0 for p in PRIORITIES}
            held = 0  # waiting for dependencies
            for raw_field, raw_value in counts.items():
                name, _, what = raw_field.decode().rpartition(":")
                entry = queue_entry(name)
                if what in by_priority:
                    n = max(int(raw_value), 0)
                    entry["queued"][what] += n
                    by_priority[what] += n
                elif what == "running":
                    entry["running"] += max(int(raw_value), 0)
                elif what == "waiting":
                    entry["waiting"] += max(int(raw_value), 0)
                    held += max(int(raw_value), 0)
                elif what == "paused":
                    entry["paused"] = entry["paused"] or raw_value == b"1"
                elif what == "limited":
                    entry["limited"] = entry["limited"] or raw_value == b"1"
                elif what == "blocked":
                    entry["blocked_until_ms"] = max(entry["blocked_until_ms"], int(raw_value))
            for raw_field, raw_value in parked.items():
                name = raw_field.decode().split(":", 1)[0]
                queue_entry(name)["parked"] += max(int(raw_value), 0)
                total["parked"] += max(int(raw_value), 0)
            shards.append(
                {"shard": shard, "queued": by_priority, "waiting": held,
                 "scheduled": scheduled, "running": running, "dead": dead}
            )  # fmt: skip
            total["waiting"] += held
            for p, n in by_priority.items():
                total[f"queued_{p}"] += n
            total["scheduled"] += scheduled
            total["running"] += running
            total["dead"] += dead
        total["queued"] = sum(total[f"queued_{p}"] for p in PRIORITIES)
        total.setdefault("parked", 0)
        return {"total": dict(total), "queues": dict(sorted(queues.items())), "shards": shards}

    async def oldest_queued(self, tenants: int = 100) -> dict[tuple[str, str], float]:
        """Seconds the oldest ready job of each (queue, priority) has waited (since it became
        ready), looking at the first ``tenants`` tenants of each rotation."""
        keys, redis = self.keys, self.redis
        pipe = redis.pipeline(transaction=False)
        for shard in range(keys.shards):
            pipe.hgetall(keys.queue_counts(shard))
        rings: list[tuple[int, str, str]] = []
        for shard, counts in enumerate(await pipe.execute()):
            for raw_field, raw_value in counts.items():
                name, _, what = raw_field.decode().rpartition(":")
                if what in PRIORITIES and int(raw_value) > 0:
                    rings.append((shard, name, what))
        if not rings:
            return {}
        pipe = redis.pipeline(transaction=False)
        for shard, name, prio in rings:
            pipe.lrange(keys.ring(shard, name, prio), 0, tenants - 1)
        heads: list[tuple[int, str, str]] = []
        pipe2 = redis.pipeline(transaction=False)
        for (shard, name, prio), members in zip(rings, await pipe.execute(), strict=True):
            for tenant in members:
                pipe2.lindex(keys.ready(shard, name, prio, tenant.decode()), -1)
                heads.append((shard, name, prio))
        ids = await pipe2.execute() if heads else []
        pipe3 = redis.pipeline(transaction=False)
        found = []
        for (shard, name, prio), job_id in zip(heads, ids, strict=True):
            if job_id is not None:
                pipe3.hmget(keys.job_in(shard, job_id.decode()), job_format.small_fields("updated"))
                found.append((name, prio))
        now = time.time() * 1000
        out: dict[tuple[str, str], float] = {}
        for key, values in zip(found, await pipe3.execute() if found else [], strict=True):
            updated = job_format.small_field(values, "updated")
            if updated is not None:
                out[key] = max(out.get(key, 0.0), (now - int(updated)) / 1000)
        return out

    async def live_workers(self) -> list[dict[str, Any]]:
        """Workers that advertised themselves lately (every third of a lease), newest first.

        A worker killed without signing off stops advertising: it is no longer live after
        ``WORKER_FRESH_SECONDS`` and its entry is deleted after ``WORKER_FORGET_SECONDS``."""
        now = time.time()
        live, gone = [], []
        for worker_id, raw in (await self.redis.hgetall(self.keys.workers())).items():
            try:
                info = msgspec.json.decode(raw)
                age = now - float(info.get("seen_at", 0))
            except (msgspec.DecodeError, TypeError, ValueError, AttributeError):
                gone.append(worker_id)
                continue
            if age <= WORKER_FRESH_SECONDS:
                live.append(info)
            elif age > WORKER_FORGET_SECONDS:
                gone.append(worker_id)
        if gone:
            await self.redis.hdel(self.keys.workers(), *gone)
        live.sort(key=lambda w: -float(w.get("seen_at", 0)))
        return live

    # --- queues ---------------------------------------------------------------------------
    async def pause(self, queue: str) -> None:
        """Stop every claim from ``queue``: submits are still accepted, running jobs finish.

        The flag is written in every shard (each claim script reads its own shard's), so once
        this returns no worker claims from the queue."""
        self._check_queue(queue)
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.hset(self.keys.queue_counts(shard), f"{queue}:paused", "1")
        await pipe.execute()

    async def resume(self, queue: str) -> None:
        """Let workers claim from ``queue`` again (and wake those that sleep)."""
        self._check_queue(queue)
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.hdel(self.keys.queue_counts(shard), f"{queue}:paused")
        for shard in range(self.keys.shards):
            pipe.execute_command("SPUBLISH", self.keys.wake(shard), f"q {queue}")
        await pipe.execute()

    async def purge(self, queue: str, *, batch: int = PURGE_BATCH) -> Purged:
        """Cancel every ready (or parked) job of ``queue``, oldest first, in every shard
        (purge.lua: each job as a cancel would, logged, so Postgres sees it cancelled).

        Each script call takes at most ``batch`` jobs out of one shard (Redis serves others
        between calls); the shards are purged side by side, one round trip per round. Jobs
        submitted while it runs are left, as are scheduled and running ones: ``remaining``
        says how many are ready when it ends (jobs held behind a concurrency key are admitted
        as the purged ones leave, and stay)."""
        self._check_queue(queue)
        if not 1 <= batch <= 10_000:
            raise InvalidRequest("batch must be between 1 and 10000", field="batch")
        budgets = dict.fromkeys(range(self.keys.shards), -1)
        left: dict[int, int] = {}
        cancelled = 0
        ttl = self.settings.retention_seconds
        while budgets:
            shards = list(budgets)
            calls = [self.scripts.purge_call(s, queue, batch, budgets[s], ttl) for s in shards]
            for shard, reply in zip(shards, await self.scripts.call_many(calls), strict=True):
                done, taken, budget, left[shard] = self.scripts.parse_purge(reply)
                cancelled += done
                if budget <= 0 or taken == 0:  # nothing taken: the lists were empty
                    del budgets[shard]
                else:
                    budgets[shard] = budget
        return Purged(queue, cancelled, sum(left.values()))

    async def set_limits(self, queue: str, limits: QueueLimits) -> QueueLimits:
        """Limit ``queue`` across every worker (or lift its limits: ``QueueLimits()``).

        The values go to the queue's home shard, where workers take permits (limit.lua); the
        catalogue tells workers which queues need permits; a flag in every shard makes a
        claim without permits take nothing from it (a worker that has not heard yet). Jobs
        already running when a limit is set finish outside it.
        """
        self._check_queue(queue)
        if limits.concurrency is not None and not 1 <= limits.concurrency <= 1_000_000:
            raise InvalidRequest("concurrency must be between 1 and 1000000", field="concurrency")
        if limits.rate is not None and not 1 <= limits.rate <= 1_000_000:
            raise InvalidRequest("rate must be between 1 and 1000000", field="rate")
        if not 0.001 <= limits.per <= 86_400:
            raise InvalidRequest("per must be between 0.001 and 86400 seconds", field="per")
        keys, redis = self.keys, self.redis
        conf = keys.limit(queue)
        if limits.limited:
            fields: dict[str | bytes, int] = {}
            gone = []
            if limits.concurrency is not None:
                fields["concurrency"] = limits.concurrency
            else:
                gone.append("concurrency")
            if limits.rate is not None:
                fields.update(rate=limits.rate, period=round(limits.per * 1000))
            else:
                gone += ["rate", "period"]
            # enforced first (home shard), then announced, then required in every shard
            await redis.hset(conf, mapping=fields)  # type: ignore[arg-type]
            if gone:
                await redis.hdel(conf, *gone)
            await redis.hset(keys.queue_limits(), queue, msgspec.json.encode(limits))
            pipe = redis.pipeline(transaction=False)
            for shard in range(keys.shards):
                pipe.hset(keys.queue_counts(shard), f"{queue}:limited", "1")
            await pipe.execute()
        else:
            pipe = redis.pipeline(transaction=False)
            for shard in range(keys.shards):
                pipe.hdel(keys.queue_counts(shard), f"{queue}:limited")
            await pipe.execute()
            await redis.hdel(keys.queue_limits(), queue)
            await redis.hdel(conf, "concurrency", "rate", "period")
            pipe = redis.pipeline(transaction=False)
            for shard in range(keys.shards):
                pipe.execute_command("SPUBLISH", keys.wake(shard), f"q {queue}")
            await pipe.execute()
        return limits

    async def limits(self) -> dict[str, QueueLimits]:
        """Every limited queue's limits."""
        raw = await self.redis.hgetall(self.keys.queue_limits())
        return {
            (name.decode() if isinstance(name, bytes) else name): _limits_decoder.decode(value)
            for name, value in sorted(raw.items())
        }

    async def running_permits(self, queue: str) -> int:
        """Permits held now for a limited queue: its jobs running under the limit."""
        return int(await self.redis.zcard(self.keys.permits(queue)))

    async def block(self, queue: str, seconds: float) -> int:
        """Start no job of ``queue`` for ``seconds`` (a task raised ``RateLimited``): every
        shard's claims skip it until then. Returns when the block ends, ms since the epoch."""
        self._check_queue(queue)
        until = int((time.time() + seconds) * 1000)
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.hget(self.keys.queue_counts(shard), f"{queue}:blocked")
        current = max((int(v) for v in await pipe.execute() if v), default=0)
        if until <= current:
            return current
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.hset(self.keys.queue_counts(shard), f"{queue}:blocked", until)
        await pipe.execute()
        return until

    def _check_queue(self, queue: str) -> None:
        self._check_name("queue", queue, QUEUE_NAME_RE, 70, "queue")

    async def waiting_by_tenant(self) -> dict[str, int]:
        """Jobs not started yet (waiting, scheduled, queued) per tenant, summed over shards."""
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.hgetall(self.keys.waiting(shard))
        out: dict[str, int] = defaultdict(int)
        for counts in await pipe.execute():
            for tenant, n in counts.items():
                out[tenant.decode()] += int(n)
        return dict(out)
