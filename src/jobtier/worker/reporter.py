"""How each attempt ended, reported to Redis: the outbox and the reporter's loop.

``run_attempt`` (attempt.py) hands each attempt's end to ``attempt_ended``, which frees the
slot and queues the outcome (``complete``, ``fail`` or ``stopped``) in the outbox, per kind
and shard; the reporter sends everything queued in one pipeline (one per cluster node) while
the next outcomes accumulate, and keeps the reports of each call that failed, to send again:
a node that is down (a master failing over) holds back its shards' reports only (nothing
acknowledged is lost; a lease that expires meanwhile makes the scheduler requeue the job,
and the late write is refused).

Races guarded here:

- a job's last progress and log lines go ahead of its outcome, in the same pipeline on one
  connection, so Redis applies them first; and the reporter waits for a heartbeat in flight
  (``beat_idle``), which may carry that progress, before it sends;
- an outcome of a job released at shutdown (or whose lease was lost) is dropped here: the job
  is back in its queue under a newer fencing token, and Redis would refuse it anyway;
- a limited queue's permit is returned only once the outcome is in Redis: before, another job
  of the queue could start while Redis still counts this one as running (over the limit);
- a task that raised ``RateLimited`` blocks its queue on every worker (``_block``), without
  using the job's attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any

from jobtier.core.errors import Code, RateLimited
from jobtier.core.model import LOG_LINES
from jobtier.runtime.backoff import REPORT
from jobtier.runtime.loop import FAULTS
from jobtier.store.calls import (
    Call,
    complete_call,
    fail_call,
    heartbeat_call,
    joblog_call,
    stopped_call,
)
from jobtier.store.context import block_queue
from jobtier.worker import attempt_spans
from jobtier.worker.attempt import DEFAULT_POLICY, STOPPED, Failure, Stopped, fail_state
from jobtier.worker.job_context import JobContext
from jobtier.worker.permits import LimitedQueues, limit_calls
from jobtier.worker.state import Running, WorkerState

log = logging.getLogger("jobtier.worker")

FLUSH_AFTER_STOP_NOW = 5.0  # s the last reports (the releases) get after stop(now=True)


class Reporter:
    """The outbox of a worker's outcomes and its loop (see the module docstring); the
    ``AttemptSink`` its attempts end into."""

    def __init__(self, state: WorkerState, limits: LimitedQueues) -> None:
        self.state = state
        self.limits = limits
        self.id = state.id
        self._running = state.running
        self._slot_free = state.slot_free
        self._stats = state.stats
        # "progress" and "logs" first: _send sends the kinds in this order (report)
        self._outbox: dict[str, dict[int, list[tuple[Any, ...]]]] = {
            "progress": defaultdict(list),
            "logs": defaultdict(list),
            "complete": defaultdict(list),
            "fail": defaultdict(list),
            "stopped": defaultdict(list),
        }
        # a limited queue's permits: of jobs whose outcome is in the outbox (queue -> the
        # job's shard and the permit's id), then of jobs whose outcome Redis has (queue ->
        # ids, to give back)
        self._pending_permits: dict[str, list[tuple[int, str]]] = defaultdict(list)
        self._to_release: dict[str, list[str]] = defaultdict(list)
        self._ready = asyncio.Event()  # an outcome is queued
        self._idle = asyncio.Event()  # everything queued is sent (the shutdown's flush)
        self._idle.set()
        self._blocks: set[asyncio.Task[None]] = set()
        self._stopped_types: dict[str, str] = {}  # job -> type, of stopped reports unsent

    def attempt_ended(self, ctx: JobContext, end: bytes | Failure | Stopped) -> None:
        """Called by ``run_attempt`` as each job's attempt ends: report it, free the slot."""
        r = self._running.pop(ctx.job.id, None)
        if r is None:  # released at shutdown (Launcher.release_all): its stop is reported
            return
        # the slot is free: the claim loops wake ahead of the reporter (see _send)
        self._slot_free.set()
        outcome = "lost"  # (its span's: attempt_spans.py)
        try:
            if isinstance(end, bytes):
                self.report("complete", r, (end,))
                outcome = "succeeded"
            elif isinstance(end, Failure):
                outcome = self._fail(r, end)
            elif end is STOPPED or not r.lost:
                # STOPPED: the task gave up for a cancel request; INTERRUPTED: a cancel
                # request, or a shutdown (release); a lost lease has nothing to report
                self.report("stopped", r, ())
                outcome = "cancelled" if end is STOPPED else "interrupted"
        finally:
            self._stats.run_time.observe(time.monotonic() - r.started)
            if r.span is not None:
                attempt_spans.end(r.span, outcome, end if isinstance(end, Failure) else None)
            if r.permit is not None:  # no outcome sent (a lost lease): give it back now
                self._to_release[r.job.queue].append(r.permit)
                self._ready.set()

    def _fail(self, r: Running, failure: Failure) -> str:
        """Report a failed attempt; "retry" when fail.lua will retry it, "failed" when not,
        "held" when it is given back uncounted (not a failure)."""
        if isinstance(failure.exc, RateLimited):
            self._rate_limited(r, failure, failure.exc)
            return "held"
        delay_ms = failure.delay_ms(r.task.retry if r.task else DEFAULT_POLICY, r.job.attempt)
        # refund: the attempt does not count (a job an open breaker held back: breaker_gate.py)
        refund = 1 if failure.refund else 0
        state = fail_state(delay_ms, r.job.attempt, r.job.max_attempts, bool(refund))
        # one record per failed attempt, with the traceback of what the task raised (a
        # refunded one, a job an open breaker held back, at debug: thousands come at once);
        # the last one, that fails the job for good (a dead letter), a warning
        level = logging.DEBUG if failure.refund else logging.INFO
        then = f"retry_in_ms={delay_ms}"
        if state == "failed":
            level, then = logging.WARNING, "dead_lettered=1"
        log.log(
            level,
            "event=job_failed job=%s type=%s attempt=%d/%d error=%s message=%r %s",
            r.job.id,
            r.job.type,
            r.job.attempt,
            r.job.max_attempts,
            failure.type,
            failure.message[:200],
            then,
            exc_info=failure.exc if failure.raised else None,
        )
        self.report("fail", r, (failure.error_json(), delay_ms, refund))
        if refund:
            return "held"
        return "retry" if state == "scheduled" else "failed"

    def _rate_limited(self, r: Running, failure: Failure, exc: RateLimited) -> None:
        """The task says the downstream wants us to wait: the job runs again then, without
        using an attempt, and its queue starts nothing meanwhile, on every worker."""
        delay_ms = round(exc.retry_after * 1000)
        error = failure.error_json()
        log.info(
            "event=queue_rate_limited job=%s type=%s queue=%s retry_in_ms=%d",
            r.job.id,
            r.job.type,
            r.job.queue,
            delay_ms,
        )
        self.report("fail", r, (error, delay_ms, 1))
        self._stats.rate_limited += 1
        task = asyncio.create_task(self._block(r.job.queue, exc.retry_after))
        self._blocks.add(task)
        task.add_done_callback(self._blocks.discard)

    async def _block(self, queue: str, seconds: float) -> None:
        try:  # a limited queue's permits wait too
            await block_queue(self.state.store, queue, seconds, limited=queue in self.limits)
        except FAULTS as exc:
            log.warning("event=queue_block_failed queue=%s error=%r", queue, exc)

    def report(self, kind: str, r: Running, extra: tuple[Any, ...]) -> None:
        """Queue the outcome ``kind`` (complete, fail, stopped) of ``r`` for the next send."""
        if r.released:
            # released at shutdown: the job is back in its queue under a newer version, and
            # this outcome's fencing token is stale (Redis would refuse it): drop it here
            if kind != "stopped":  # "stopped" is only the task's cancellation, which we caused
                log.info(
                    "event=late_outcome_dropped worker=%s job=%s report=%s: the job was "
                    "released at shutdown",
                    self.id,
                    r.job.id,
                    kind,
                )
            return
        # (_log is None unless the task ever logged: nothing to look at for most jobs)
        lines = r.ctx._take_logs() if r.ctx._log is not None else None
        if lines:
            # the last lines go ahead of the outcome, and expire with the job as it ends
            s = self.state.settings
            ttl = s.dead_retention_seconds if kind == "fail" else s.retention_seconds
            self._outbox["logs"][r.shard].append((r.job.id, ttl, lines))
        if r.progress is not None:
            # progress the heartbeat has not taken yet (reported just before the end) goes
            # ahead of the outcome in the same pipeline, one connection, so Redis applies
            # it first; sent later, it would find the job finished and be refused
            self._outbox["progress"][r.shard].append((r.job.id, r.job.lease_version, r.progress))
            r.progress = None
        self._outbox[kind][r.shard].append((r.job.id, r.job.lease_version, *extra))
        if kind == "stopped":  # its type, for the line that says it was released (account)
            self._stopped_types[r.job.id] = r.job.type
        if r.permit is not None:
            # returned once the outcome is in Redis: before, a new job of the queue could
            # start while Redis still counts this one as running (over the limit)
            self._pending_permits[r.job.queue].append((r.shard, r.permit))
            r.permit = None
        self._idle.clear()
        self._ready.set()

    async def run(self) -> None:
        """Send what is queued, as it is queued, until cancelled."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            await self._send()

    async def _send(self) -> None:
        """Send everything in the outbox in one pipeline (one per node); keep the reports of
        the calls that failed, and back off before sending them again."""
        backoff = REPORT.start()
        while True:
            # one turn of the event loop first: the claim for the slots these ends freed
            # (attempt_ended wakes the claim loops first) goes to Redis ahead of their
            # outcomes, and the worker starts those jobs while Redis records the outcomes
            await asyncio.sleep(0)
            # a heartbeat in flight may carry the last progress of a job reported here:
            # the outcome must reach Redis after it
            await self.state.beat_idle.wait()
            batches = {kind: dict(by_shard) for kind, by_shard in self._outbox.items() if by_shard}
            if not batches:
                if self._to_release and not await self._release_permits():
                    await asyncio.sleep(backoff.next())
                    continue
                self._idle.set()
                return
            for by_shard in self._outbox.values():
                by_shard.clear()
            permits = dict(self._pending_permits)
            self._pending_permits.clear()
            calls: list[Call] = []
            kinds: list[tuple[str, int, list[tuple[Any, ...]]]] = []
            state = self.state
            s = state.settings
            for kind, by_shard in batches.items():
                for shard, items in by_shard.items():
                    if kind == "progress":
                        calls.append(
                            heartbeat_call(shard, self.id, state.lease_ms, items, state.history_ms)
                        )
                    elif kind == "logs":
                        calls.append(joblog_call(shard, LOG_LINES, items))
                    elif kind == "complete":
                        calls.append(complete_call(shard, self.id, s.retention_seconds, items))
                    elif kind == "fail":
                        calls.append(fail_call(shard, self.id, s.dead_retention_seconds, items))
                    else:
                        calls.append(stopped_call(shard, self.id, s.retention_seconds, items))
                    kinds.append((kind, shard, items))
            try:
                # one pipeline per node, each call's reply on its own: a node that is down (a
                # master failing over) fails its shards' reports only, the others' are taken
                replies = await state.scripts.call_many_each(calls)
            except FAULTS as exc:
                replies = [exc] * len(calls)
            failed, lost = self._take_replies(kinds, replies)
            # a permit is given back once every call of its job's shard in the round landed:
            # its outcome is in Redis then; those of the shards whose node is down (a master
            # failing over) wait for the round that sends their outcomes again
            for queue_name, held in permits.items():
                self._to_release[queue_name] += [p for shard, p in held if shard not in lost]
                kept = [(shard, p) for shard, p in held if shard in lost]
                if kept:
                    self._pending_permits[queue_name][:0] = kept
            if failed is None:
                continue
            # now, the lost shards' outcomes may take a while; unless the permits' own home
            # is lost (the call, retried by the client, would only hold up this loop)
            homes = {self.state.keys.home(queue_name) for queue_name in self._to_release}
            if self._to_release and not homes & lost:
                await self._release_permits()
            wait = backoff.next()
            log.warning(
                "event=report_failed worker=%s error=%r retry_in=%.2fs", self.id, failed, wait
            )
            await asyncio.sleep(wait)

    def _take_replies(
        self, kinds: list[tuple[str, int, list[tuple[Any, ...]]]], replies: list[Any]
    ) -> tuple[Exception | None, set[int]]:
        """Account the calls that got a reply; put the failed calls' reports back in front of
        the outbox (in their order), to send again. Returns the first failure, if any, and
        the shards of the failed calls.

        Nothing is lost: a failed call that never ran is sent again; an outcome that ran but
        whose reply was lost (the connection dropped) is refused as stale when sent again,
        the job having ended under its fencing token (log lines sent again may be kept
        twice: they are not fenced); a lease that expires meanwhile makes the scheduler
        requeue the job, and our late write is refused."""
        failed: Exception | None = None
        lost: set[int] = set()
        for (kind, shard, items), reply in zip(kinds, replies, strict=True):
            if isinstance(reply, Exception):
                self._outbox[kind][shard][:0] = items
                failed = failed or reply
                lost.add(shard)
            else:
                self.account(kind, items, reply)
        return failed, lost

    async def _release_permits(self) -> bool:
        """Return the permits of finished jobs (permits.py); False if Redis refused (kept)."""
        by_queue = {q: ids for q, ids in self._to_release.items() if ids}
        self._to_release.clear()
        try:
            await self.state.scripts.call_many(limit_calls(self.state.keys, "release", by_queue, 0))
        except FAULTS as exc:
            for q, ids in by_queue.items():
                self._to_release[q] += ids
            log.warning("event=permit_release_failed worker=%s error=%r", self.id, exc)
            return False
        return True

    def account(self, kind: str, items: list[tuple[Any, ...]], reply: list[Any]) -> None:
        """Count what Redis made of the reports of ``kind``: one reply per call."""
        if kind in ("progress", "logs"):
            return  # if refused, the outcome sent behind it is refused too, and counted
        st = self._stats
        if kind == "complete":  # a code per job; OK means succeeded
            codes, states = reply, [b"succeeded"] * len(reply)
        else:  # (code, state) per job
            codes, states = reply[0::2], reply[1::2]
        # codes stay ints on this path: a Code built per job only to be compared is waste
        for item, code, state in zip(items, codes, states, strict=True):
            job_type = self._stopped_types.pop(item[0], "") if kind == "stopped" else ""
            if code != Code.OK:
                st.refused += 1
                log.warning(
                    "event=stale_write_refused worker=%s job=%s report=%s code=%s",
                    self.id,
                    item[0],
                    kind,
                    Code(code).name,
                )
            elif state == b"succeeded":
                st.succeeded += 1
            elif state == b"scheduled":
                st.retried += 1
            elif state == b"failed":
                st.failed += 1
            elif state == b"cancelled":
                st.cancelled += 1
                if kind == "fail":  # logged above as retried: fail.lua ended it instead
                    log.info(
                        "event=job_cancelled worker=%s job=%s: its failed attempt ended it, not "
                        "retried (a cancel was asked, or its retry would be due after its "
                        "expiry: its error says which)",
                        self.id,
                        item[0],
                    )
            elif state == b"queued":  # released (at shutdown): logged once Redis has it
                st.released += 1
                log.info("event=job_released worker=%s job=%s type=%s", self.id, item[0], job_type)

    async def flush(self) -> None:
        """Until every report is sent: 30 s at most, ``FLUSH_AFTER_STOP_NOW`` after a
        ``stop(now=True)`` (what is still unsent then is left to lease expiry)."""
        start = time.monotonic()
        while not self._idle.is_set() or any(self._outbox.values()):
            limit = FLUSH_AFTER_STOP_NOW if self.state.stop_now.is_set() else 30.0
            if time.monotonic() - start >= limit:
                log.warning(
                    "event=reports_unsent worker=%s: Redis did not take the last reports; "
                    "their jobs return to their queues when their leases expire",
                    self.id,
                )
                return
            self._ready.set()
            await asyncio.sleep(0.005)
