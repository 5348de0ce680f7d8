"""Producing jobs: validate, then submit one, a batch, or a flow.

Input is validated before anything is sent: a bad request raises ``InvalidRequest`` (or
``UnknownTask``) and changes nothing. A job's own webhook (``callback``) is written before
its submit reaches Redis, so the dispatcher finds it for the job's first transition; it is
deleted again for every id the submit did not create.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

import msgspec

from jobtier.core.debounce import Debounce, Throttle, Throttled, Unique
from jobtier.core.errors import (
    Code,
    ConfigError,
    IdempotencyConflict,
    InvalidRequest,
    PayloadTooLarge,
    UnknownTask,
)
from jobtier.core.model import (
    DEFAULT_QUEUE,
    PRIORITIES,
    CallbackSpec,
    FlowJob,
    FlowSubmitted,
    JobSpec,
    OnDependencyFailure,
    Priority,
    Submitted,
    TaskInfo,
    TaskLookup,
    encode_json,
    expiry_fields,
    job_ids,
)
from jobtier.core.names import QUEUE_NAME_RE, TASK_NAME_RE, TENANT_RE
from jobtier.core.sealing import PREFIX, KeysNotConfigured
from jobtier.engine import keyed as by_key
from jobtier.engine import validate
from jobtier.flows import submit as flows
from jobtier.flows.plan import plan_flow
from jobtier.store.calls import SubmitItem
from jobtier.store.context import Store, submit_items

DEFAULT_TENANT = "default"
T = TypeVar("T")

Callbacks = Sequence[tuple[str, CallbackSpec, str]]  # (job id, callback, field prefix)


class Registrar(Protocol):
    """Where jobs' callbacks are written before their submit (``webhooks/callbacks.py``).

    ``register`` checks every callback before it writes any (``InvalidRequest`` naming the
    field). ``forget`` deletes those of jobs a submit did not create, logging rather than
    raising when the store is away (an orphan callback names a job that never runs)."""

    async def register(self, tenant: str, callbacks: Callbacks) -> None: ...

    async def forget(self, job_ids: Sequence[str]) -> None: ...


class Describes(Protocol):
    """A task as a submit may be given it (``worker.registry.Task``)."""

    @property
    def name(self) -> str: ...

    @property
    def queue(self) -> str: ...

    @property
    def max_attempts(self) -> int: ...

    def infos(self) -> dict[str, TaskInfo]: ...


class Producer:
    """Submits jobs to one deployment.

    ``tasks`` gives a task's queue, attempts and payload check (a ``TaskRegistry``, or the
    workers' ``TaskCatalog``); with ``require_known``, a type it does not know is refused.
    ``callbacks`` writes jobs' own webhooks; without it, a job given one is refused."""

    def __init__(
        self,
        store: Store,
        tasks: TaskLookup | None,
        require_known: bool,
        callbacks: Registrar | None,
    ) -> None:
        self.store = store
        self.settings = store.settings
        self.keys = store.keys
        self.tasks = tasks
        self.require_known = require_known
        self.callbacks = callbacks
        # tasks handed to submit() as objects, and their compensations
        self._local: dict[str, TaskInfo] = {}
        # encryption at rest (docs/encryption.md): the queues whose jobs are sealed, and the
        # keys (a task's own opt-in, @task(encrypt=True), comes with its TaskInfo)
        self._sealed_queues = self.settings.encrypted_queue_names()
        keyring = store.keyring
        self._seal: Callable[[str, bytes], bytes] | None = None
        if keyring is not None:
            seal = keyring.seal
            self._seal = lambda job_id, payload: seal(job_id, "payload", payload)

    def know(self, task: Describes) -> None:
        """Know ``task`` and its compensation task without a registry."""
        self._local.update(task.infos())

    def _task_info(self, type: str) -> TaskInfo | None:
        info = self.tasks.info(type) if self.tasks is not None else None
        return info if info is not None else self._local.get(type)

    def known(self, type: str) -> bool:
        """Whether a submit of ``type`` would find its task (or need none)."""
        return self.tasks is None or not self.require_known or self._task_info(type) is not None

    async def ensure_known(self, types: Iterable[Any]) -> None:
        """Before ``prepare``: let a catalogue look again for types it does not know yet (a
        worker that just started)."""
        ensure = getattr(self.tasks, "ensure", None)
        if ensure is not None:
            await ensure({t for t in types if isinstance(t, str)})

    async def task_defaults(
        self, type: str, queue: str | None, max_attempts: int | None, payload: Any = None
    ) -> tuple[str, int]:
        """(queue, attempts) for a schedule's jobs: those given, else the task's, else the
        defaults; ``InvalidRequest`` as ``prepare``."""
        await self.ensure_known((type,))
        spec = JobSpec(type=type, payload=payload, queue=queue, max_attempts=max_attempts)
        item = self.prepare(spec, DEFAULT_TENANT)
        if item.seal is not None:
            # a schedule's payload is kept (Redis, Postgres) to make each slot's job from,
            # and would be kept in the clear
            raise InvalidRequest(
                f"task {type!r} in queue {item.queue!r} has its payloads encrypted, which "
                "schedules do not support (docs/encryption.md)",
                field="type",
            )
        return item.queue, item.max_attempts

    def prepare(self, spec: JobSpec, tenant: str, job_id: str | None = None) -> SubmitItem:
        """Validate one job and turn it into the submit script's arguments."""
        s = self.settings
        validate.check_name("tenant", tenant, TENANT_RE, 70, None)
        validate.check_name("type", spec.type, TASK_NAME_RE, 140, "type")
        task = self._task_info(spec.type)
        if task is None and self.tasks is not None and self.require_known:
            names = self.tasks.names()
            known = ", ".join(names[:20]) + (", …" if len(names) > 20 else "") or "none"
            raise UnknownTask(
                f"no worker runs task {spec.type!r} (known: {known}); start a worker that has "
                "it (an HTTP worker advertises it: PUT /v1/worker/tasks), or set "
                "JOBTIER_REQUIRE_KNOWN_TYPES=0 to accept jobs before their workers",
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
        # the checks of options left unset (most jobs) are skipped: this runs once per job
        attempts = spec.max_attempts
        if attempts is None:
            attempts = task.max_attempts if task else s.default_max_attempts
        else:
            attempts = validate.max_attempts(attempts)
        if spec.run_at is None and spec.delay is None:
            run_at_ms = delay_ms = 0
        else:
            run_at_ms, delay_ms = validate.timing(spec, s)
        if spec.expires_at is None and spec.expires_in is None:
            expires_at_ms = expires_in_ms = 0
        else:
            expires_at_ms, expires_in_ms = validate.expiry(spec, s, run_at_ms, delay_ms)
        timeout_ms = 0 if spec.timeout is None else validate.period_ms(spec.timeout, "timeout", s)
        key = spec.idempotency_key
        key = "" if key is None else validate.check_key(key, "idempotency_key")
        queue = spec.queue
        if queue is None:
            queue = task.queue if task else DEFAULT_QUEUE
        else:
            validate.check_name("queue", queue, QUEUE_NAME_RE, 70, "queue")
        if spec.concurrency_key is None and spec.concurrency_limit is None:
            ckey, climit = "", 1
        else:
            ckey, climit = validate.concurrency(spec)
        keyed = None
        if spec.debounce is not None or spec.throttle is not None or spec.unique is not None:
            keyed = by_key.option(spec, s)
            if expires_at_ms or expires_in_ms or timeout_ms:
                field = "expires_in" if expires_in_ms else "timeout"
                field = "expires_at" if expires_at_ms else field
                raise InvalidRequest(
                    f"{field} cannot be combined with debounce, throttle or unique: a keyed job "
                    "takes no expiry and no timeout of its own",
                    field=field,
                )
        if task is not None:  # the payload's schema after the job's options: a 422 names
            task.validate(spec.payload)  # a bad option first, as it does without a schema
        if job_id is None:
            # a concurrency key's count and waiting jobs live in one shard, so its jobs do too
            # (and their idempotency records: the idempotency key is then scoped to it)
            if keyed is not None:  # so do a debounce, throttle or unique key's (engine/keyed.py)
                shard: int | None = by_key.shard(self.keys, tenant, queue, spec.type, keyed)
            elif ckey:
                shard = self.keys.shard_for(tenant, "\x01ck", ckey)
            else:
                shard = self.keys.shard_for(tenant, key) if key else None
            job_id = self.keys.new_id(shard)
        seal = None
        if (task is not None and task.encrypt) or queue in self._sealed_queues:
            seal = self._sealer(spec.type)
            by_key.check_sealed(keyed)
        elif payload[:13] == PREFIX:
            # a worker takes a payload so marked for a sealed one and would fail the job
            # (a sealed job's is sealed again: it arrives as it was sent)
            raise InvalidRequest(
                'payload: an object whose first member is "$enc": "v1" reads as an encrypted '
                "value (docs/encryption.md); put another member first, or wrap it",
                field="payload",
            )
        deps: list[str] = []
        if spec.depends_on is not None or spec.on_dependency_failure is not None:
            deps = validate.depends_on(spec, self.keys, s.max_flow_jobs)
        compensation = ""
        if task is not None and task.on_failure:
            comp = self._task_info(task.on_failure)
            compensation = (
                f"{task.on_failure} {comp.queue if comp else DEFAULT_QUEUE} "
                f"{comp.max_attempts if comp else s.default_max_attempts}"
            )
        flow = flows.flow_blob(
            compensation=compensation,
            deps=deps,
            run_on_failure=spec.on_dependency_failure == "run",
            link_ms=round(s.flow_link_timeout_seconds * 1000),
        )
        return SubmitItem(
            job_id,
            tenant,
            spec.type,
            spec.priority,
            payload,
            attempts,
            run_at_ms,
            delay_ms,
            key,
            validate.request_hash(spec, payload, deps) if key else "",
            queue,
            ckey,
            climit,
            flow,
            compensation,
            tuple(deps),
            seal,
            keyed=keyed,
            expires_at_ms=expires_at_ms,
            expires_in_ms=expires_in_ms,
            timeout_ms=timeout_ms,
        )

    def _sealer(self, type: str) -> Callable[[str, bytes], bytes]:
        if self._seal is None:
            raise KeysNotConfigured(
                f"task {type!r} has its payloads encrypted (@task(encrypt=True) or "
                "JOBTIER_ENCRYPTED_QUEUES) and this producer has no JOBTIER_ENCRYPTION_KEYS "
                "to encrypt them with"
            )
        return self._seal

    async def submit(
        self,
        type: str | Describes,
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
        debounce: Debounce | Mapping[str, Any] | None = None,
        throttle: Throttle | Mapping[str, Any] | None = None,
        unique: Unique | Mapping[str, Any] | None = None,
        expires: datetime | timedelta | float | None = None,
        timeout: timedelta | float | None = None,
    ) -> Submitted:
        """Submit one job. A repeated ``idempotency_key`` with the same type and payload
        returns the original job (``created`` False); with another, ``IdempotencyConflict``.
        Given a task, its queue and attempts are the defaults. ``depends_on``: ids (or one) it
        waits for. ``callback``: the job's own webhook (a URL alone: its terminal state).
        ``debounce``, ``throttle``, ``unique``: docs/debounce-throttle.md (``Throttled`` when
        refused; a unique key's job unfinished: that job, ``created`` False). ``expires``: a
        time (with a zone), or seconds (a number or a ``timedelta``) from now, after which the
        job, not started, is cancelled rather than run (docs/expiry.md). ``timeout``: seconds
        (or a ``timedelta``) each attempt may run, in place of the task's ``timeout``."""
        if not isinstance(type, str):
            if not hasattr(type, "infos"):  # checked by prepare() as any bad name is
                raise InvalidRequest(f"type {str(type)[:140]!r} is not a task name", field="type")
            self.know(type)
            queue = type.queue if queue is None else queue
            max_attempts = type.max_attempts if max_attempts is None else max_attempts
            type = type.name
        if isinstance(run_at, bool):
            raise InvalidRequest("run_at must be a datetime or a Unix time", field="run_at")
        when = (
            datetime.fromtimestamp(run_at).astimezone()
            if isinstance(run_at, int | float)
            else run_at
        )
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
            depends_on=job_ids(depends_on),
            on_dependency_failure=on_dependency_failure,
            callback=CallbackSpec(url=callback) if isinstance(callback, str) else callback,
            debounce=by_key.as_option(debounce, Debounce, "debounce"),
            throttle=by_key.as_option(throttle, Throttle, "throttle"),
            unique=by_key.as_option(unique, Unique, "unique"),
            **expiry_fields(expires),
            timeout=timeout,  # type: ignore[arg-type]  # a timedelta too: prepare() converts
        )
        (result,) = await self.submit_many([spec], tenant=tenant)
        if isinstance(result, Exception):
            raise result
        return result

    async def submit_many(
        self, specs: Sequence[JobSpec], *, tenant: str = DEFAULT_TENANT
    ) -> list[Submitted | IdempotencyConflict]:
        """Submit jobs in one round trip per Redis node. Every spec is validated first: one
        bad spec raises ``InvalidRequest`` naming its index, and nothing is submitted.
        Idempotency conflicts are returned in place."""
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
        return await self.submit_prepared(items, callbacks=[spec.callback for spec in specs])

    async def submit_prepared(
        self,
        items: Sequence[SubmitItem],
        *,
        batch: bool | None = None,
        callbacks: Sequence[CallbackSpec | None] = (),
        registrar: Registrar | None = None,
    ) -> list[Submitted | IdempotencyConflict]:
        """Submit jobs validated by ``prepare``, each with its ``callbacks`` entry (written
        through ``registrar``, else the producer's). The jobs their ``depends_on`` names must
        be the tenant's and in Redis (else ``InvalidRequest`` naming ``jobs[i].depends_on``,
        or ``depends_on`` when not ``batch``); dependents are linked before this returns."""
        if batch is None:
            batch = len(items) > 1
        if batch:  # a batch answers per job, a throttle's refusal for the whole request
            by_key.alone([item.keyed for item in items])

        def prefix(i: int) -> str:
            return f"jobs[{i}]." if batch else ""

        ours = [
            (item.job_id, cb, f"{prefix(i)}callback.")
            for i, (item, cb) in enumerate(zip(items, callbacks, strict=False))
            if cb is not None
        ]

        async def send() -> list[Submitted | IdempotencyConflict]:
            wanted = [
                (f"{prefix(i)}depends_on", dep)
                for i, it in enumerate(items)
                for dep in it.depends_on
            ]
            if wanted:
                await flows.check_dependencies(self.store, wanted, items[0].tenant)
            outcomes = await submit_items(self.store, items)
            results: list[Submitted | IdempotencyConflict] = []
            dependents = []
            for item, outcome in zip(items, outcomes, strict=True):
                if outcome.code is Code.IDEMPOTENCY_CONFLICT:
                    results.append(IdempotencyConflict(item.idempotency_key, outcome.job_id))
                    continue
                results.append(Submitted(outcome.job_id, outcome.doc, outcome.code is Code.OK))
                if item.depends_on:  # a duplicate too: its submit may have been cut short
                    dependents.append((outcome.job_id, item.depends_on))
            if dependents:
                await flows.settle(self.store, items[0].tenant, dependents)
            return results

        def made(results: list[Submitted | IdempotencyConflict]) -> set[str]:
            return {r.job_id for r in results if isinstance(r, Submitted) and r.created}

        return await self._with_callbacks(
            registrar, items[0].tenant if items else "", ours, send, made
        )

    async def prepare_flow(
        self, jobs: Sequence[FlowJob], tenant: str, idempotency_key: str | None = None
    ) -> flows.PreparedFlow:
        """Check a flow (``submit_flow``) and prepare its jobs; nothing is sent."""
        key = validate.check_key(idempotency_key, "idempotency_key")
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
        await flows.check_dependencies(
            self.store,
            [(f"jobs[{n.index}].depends_on", dep) for n in plan.nodes for dep in n.depends_on],
            tenant,
        )
        callbacks = tuple(job.callback for job in jobs)
        return flows.PreparedFlow(plan, items, tenant, key, callbacks)

    async def submit_flow(
        self,
        jobs: Sequence[FlowJob],
        *,
        tenant: str = DEFAULT_TENANT,
        idempotency_key: str | None = None,
    ) -> FlowSubmitted:
        """Submit a flow: jobs that wait for others of the flow (``after``, by ``ref``) or
        for existing jobs (``depends_on``). A job runs once all it waits for has succeeded,
        and finds their results in ``ctx.dependencies``. ``jobtier.flows.chain`` and
        ``fan_in`` build flows.

        ``InvalidRequest`` (nothing submitted) for a cycle, an unknown ref or id, a flow over
        ``JOBTIER_MAX_FLOW_JOBS``, or a job that does not validate. A repeated
        ``idempotency_key`` with the same jobs returns the flow it made (``created`` False),
        finishing its submit if that was cut short; with other jobs, ``IdempotencyConflict``.
        """
        return await self.submit_flow_prepared(
            await self.prepare_flow(jobs, tenant, idempotency_key)
        )

    async def submit_flow_prepared(
        self, prepared: flows.PreparedFlow, registrar: Registrar | None = None
    ) -> FlowSubmitted:
        """Submit a flow checked by ``prepare_flow``, its callbacks written first."""
        ours = []
        if any(prepared.callbacks):
            ids = flows.planned_ids(self.store, prepared)
            ours = [
                (job_id, cb, f"jobs[{i}].callback.")
                for i, (job_id, cb) in enumerate(zip(ids, prepared.callbacks, strict=True))
                if cb is not None
            ]

        def made(outcome: FlowSubmitted) -> set[str]:
            return {job.job_id for job in outcome.jobs if job.created}

        return await self._with_callbacks(
            registrar, prepared.tenant, ours, lambda: flows.submit_flow(self.store, prepared), made
        )

    async def _with_callbacks(
        self,
        registrar: Registrar | None,
        tenant: str,
        callbacks: Callbacks,
        send: Callable[[], Awaitable[T]],
        made: Callable[[T], set[str]],
    ) -> T:
        """``send`` the submit with ``callbacks`` written first, and deleted again for every
        id it did not create (all when refused; a duplicate's, whose first job keeps its own)."""
        if not callbacks:
            return await send()
        registrar = registrar or self.callbacks
        if registrar is None:
            # dropping the callback would submit a job whose webhook never comes
            raise ConfigError(
                "a job's callback is written to Postgres, and this producer has no callback "
                "store: give it one (webhooks.callbacks.CallbackStore), or submit without "
                "callback"
            )
        await registrar.register(tenant, callbacks)
        ids = [job_id for job_id, _, _ in callbacks]
        try:
            outcome = await send()
        except (IdempotencyConflict, InvalidRequest, Throttled):  # refused: no job was made
            await registrar.forget(ids)
            raise
        # any other error (Redis lost mid-submit) keeps them: the jobs may exist
        created = made(outcome)
        unused = [job_id for job_id in ids if job_id not in created]
        if unused:
            await registrar.forget(unused)
        return outcome
