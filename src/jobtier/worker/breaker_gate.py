"""A worker's side of the circuit breakers: ask before a job of a breaker starts, tell after.

Before a job of a task with a breaker (``@task(breaker=...)``) starts, the worker asks the
breaker in Redis (``breaker.lua`` admit). Closed: the job runs. Open, or half-open with its
probes out: the task is not called; the job goes back to wait until the breaker may let it
through, its attempt refunded (``BreakerOpen``, reported as ``fail`` with refund, as
``RateLimited`` is). Half-open: the job runs as a probe.

A worker that met an open breaker also stops claiming its task types until the wait is over
(``hold_types``): the claim script then hands their jobs back untouched and parks them (no
transition, no attempt, as for a type the worker lacks: claim.lua), so a held job costs one
hand-back per outage rather than a claim and a reschedule per open period; claims take the
parked jobs first once the types are claimed again. Each worker learns on its own (the first
jobs it claims after an open period are asked about: about a claim's worth held back; the
worker whose record tripped it holds the types for ``open_for``, not a longer backed-off
period, and learns the rest from its next claim).

After it ran, a failure the task marks as the downstream's (``DownstreamDown``, the classes of
``breaker_on``) is recorded against the breaker; a success is recorded when it was a probe
(it closes the breaker) or the breaker counts a failure ratio. The record goes out on its own
task: the job's outcome does not wait for it.

A breaker Redis cannot be asked about lets the job run (it fails open): the job's own
retries still bound what it does, and an unreachable Redis stops the worker's claims anyway.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine
from typing import Any

from redis.exceptions import RedisError

from jobtier.core.breaker import BreakerOpen, DownstreamDown
from jobtier.store.breaker_state import Admission, BreakerStates
from jobtier.worker.attempt import INTERRUPTED, AttemptSink, Failure, Stopped
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import Task
from jobtier.worker.state import WorkerState

log = logging.getLogger("jobtier.worker")

# A waiting job comes back after the breaker's wait plus up to this share of it: the jobs
# turned away together must not all come back in the same millisecond.
WAIT_SPREAD = 0.2
# In a claim's list of task types, a name no task can have (TASK_NAME_RE): a worker whose
# every type is held back claims none of them (an empty list would mean "any type").
NO_TYPE = "-"
LIFT_GRACE = 5.0  # s after a hold ends during which a hand-back is still the hold's

MakeAttempt = Callable[[AttemptSink], Coroutine[Any, Any, None]]


class _Ended:
    """Holds how the attempt ended, until the breaker is told."""

    end: bytes | Failure | Stopped = INTERRUPTED

    def attempt_ended(self, ctx: JobContext, end: bytes | Failure | Stopped) -> None:
        self.end = end


def outcome_of(task: Task, end: bytes | Failure | Stopped, probe: str) -> str | None:
    """What breaker.lua records for ``end``: f (the downstream failed), s (it answered), n (a
    probe given back, neither), or None (nothing to record)."""
    breaker = task.breaker
    if isinstance(end, Failure):
        if isinstance(end.exc, DownstreamDown) or (
            task.breaker_on and isinstance(end.exc, task.breaker_on)
        ):
            return "f"
    elif isinstance(end, bytes) and (probe or (breaker is not None and breaker.ratio)):
        return "s"
    return "n" if probe else None


class BreakerGate:
    """Asks and tells the breakers for one worker's jobs."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.states = BreakerStates(state.store)
        self.worker = state.id
        self.lease_ms = state.lease_ms  # a probe's lease: the job's
        self.holds: dict[str, int] = {}  # breaker -> jobs not started because it was open
        self._records: set[asyncio.Task[None]] = set()
        self._types_of: dict[str, set[str]] = {}  # breaker -> this worker's task types of it
        for name in state.registry.names():
            t = state.registry.get(name)
            if t is not None and t.breaker is not None:
                self._types_of.setdefault(t.breaker.name, set()).add(name)
        self._held: dict[str, asyncio.TimerHandle] = {}  # breaker -> when its types come back
        self.on_lift: Callable[[], None] = lambda: None  # the claimer's: look at the shards again

    def hold_types(self, name: str, seconds: float) -> None:
        """Claim no job of breaker ``name``'s task types for ``seconds``."""
        handle = self._held.pop(name, None)
        if handle is not None:
            handle.cancel()
        self._held[name] = asyncio.get_running_loop().call_later(seconds, self.lift, name)
        self._set_types()

    def lift(self, name: str) -> None:
        """Claim breaker ``name``'s task types again (its wait is over, or it closed)."""
        handle = self._held.pop(name, None)
        if handle is None:
            return
        handle.cancel()
        self._set_types()
        # claims sent with the held list may still hand jobs back: expected a while longer
        self.state.types_held = True
        asyncio.get_running_loop().call_later(LIFT_GRACE, self._set_types)
        self.on_lift()

    def _set_types(self) -> None:
        held = {t for name in self._held for t in self._types_of.get(name, ())}
        types = [t for t in self.state.registry.names() if t not in held]
        self.state.types = types or [NO_TYPE]
        self.state.types_held = bool(held)

    async def run(self, task: Task, ctx: JobContext, sink: AttemptSink, make: MakeAttempt) -> None:
        """Run the attempt ``make(sink)`` would, if ``task``'s breaker lets it."""
        breaker = task.breaker
        assert breaker is not None
        admission: Admission | None = None
        try:
            admission = await self.states.admit(breaker, self.worker, self.lease_ms, ctx.type)
        except asyncio.CancelledError:  # shutdown or a cancel before it started
            sink.attempt_ended(ctx, INTERRUPTED)
            return
        except (RedisError, OSError) as exc:
            log.warning("event=breaker_unreachable breaker=%s error=%r", breaker.name, exc)
        if admission is not None and not admission.runs:
            self.holds[breaker.name] = self.holds.get(breaker.name, 0) + 1
            wait = admission.wait_ms / 1000
            if breaker.name not in self._held:
                self.hold_types(breaker.name, wait)
            wait += random.uniform(0, wait * WAIT_SPREAD)
            held = BreakerOpen(breaker.name, admission.state, round(wait, 3))
            failure = Failure(held, "BreakerOpen", str(held), True, wait, refund=True, raised=False)
            sink.attempt_ended(ctx, failure)
            return
        probe = admission.probe if admission is not None else ""
        ended = _Ended()
        keeper = asyncio.create_task(self._keep(breaker.name, probe)) if probe else None
        try:
            await make(ended)
        finally:
            if keeper is not None:
                keeper.cancel()
        end = ended.end
        outcome = outcome_of(task, end, probe)
        if outcome is not None:
            reason = end.message if isinstance(end, Failure) else ""
            record = asyncio.create_task(self._record(task, outcome, probe, reason, ctx.type))
            self._records.add(record)
            record.add_done_callback(self._records.discard)
        sink.attempt_ended(ctx, end)

    async def _keep(self, name: str, probe: str) -> None:
        """Extend a running probe's place as the job's heartbeats extend its lease: a job
        longer than the lease would otherwise let another probe through."""
        interval = self.lease_ms / 3000  # as often as the heartbeat (a third of the lease)
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self.states.extend(name, probe, self.lease_ms):
                    return  # answered, or the breaker closed or opened again
            except (RedisError, OSError) as exc:
                log.warning("event=breaker_extend_failed breaker=%s error=%r", name, exc)

    async def _record(self, task: Task, outcome: str, probe: str, reason: str, type: str) -> None:
        breaker = task.breaker
        assert breaker is not None
        try:
            state, changed = await self.states.record(breaker, outcome, probe, reason, type)
        except (RedisError, OSError) as exc:
            log.warning("event=breaker_record_failed breaker=%s error=%r", breaker.name, exc)
            return
        if not changed:
            return
        log.info("event=breaker_%s breaker=%s reason=%r", state, breaker.name, reason[:200])
        if state == "open":  # this worker tripped it: hold its types at once
            self.hold_types(breaker.name, breaker.open_for)
        elif state == "closed":  # a probe of this worker's succeeded: its jobs may start
            self.lift(breaker.name)
