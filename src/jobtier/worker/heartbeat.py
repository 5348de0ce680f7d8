"""The heartbeat: lease renewal, progress and log lines, and cancel requests.

Every third of the lease the heartbeat extends the leases of all running jobs (and the
permits of limited queues' jobs) in one pipeline (one per cluster node: a node that is down
fails its shards' extensions only, tried again soon), advertises the worker and re-reads which
of its queues are limited. Between full beats, a progress beat (at most every
``progress_interval``) carries the progress reports and log lines the tasks made. A refused
beat means the lease was lost (it expired and the job moved on): the task is stopped and its
outcome dropped.

A cancel request reaches the worker sooner than a heartbeat: ``cancel.lua`` publishes
``x <job id> <worker id>`` on the shard's wake channel, which every worker already listens
to, and the worker named there stops the task at once (``on_cancel_push``). Pub/sub can
drop a message (a reconnect); the heartbeat, which reports the request too, is the safety
net. The push may overtake the claim reply on the command connection: a push for a job not
(yet) running is left to the launcher, which delivers it when the job starts.

The loop is stopped by a flag (``stop``), not by cancelling it: a cancellation landing inside
the Redis client during a beat can be swallowed there (runtime/stopping.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import defaultdict

from redis.exceptions import RedisError

from jobtier.core.errors import Code
from jobtier.core.model import LOG_LINES, encode_json
from jobtier.engine.catalog import publish as publish_tasks
from jobtier.runtime.loop import FAULTS, wait_for
from jobtier.runtime.stopping import stop_task
from jobtier.store.calls import heartbeat_call, joblog_call, parse_pairs
from jobtier.worker.attempt import deliver_cancel
from jobtier.worker.claimer import Claimer
from jobtier.worker.launcher import Launcher
from jobtier.worker.permits import limit_calls
from jobtier.worker.state import WorkerState

log = logging.getLogger("jobtier.worker")


class Heartbeat:
    """A worker's heartbeat and cancel requests (see the module docstring)."""

    def __init__(
        self, state: WorkerState, claimer: Claimer, launcher: Launcher, progress_interval: float
    ) -> None:
        self.state = state
        self.id = state.id
        self.claimer = claimer
        self.launcher = launcher
        self.progress_interval = progress_interval
        self._stop = asyncio.Event()
        # a running job's log lines live as long as the job could (a failure keeps it longer)
        s = state.settings
        self._lines_ttl = max(s.retention_seconds, s.dead_retention_seconds)

    def on_cancel_push(self, data: bytes) -> None:
        """``x <job id> <worker id>`` on a wake channel: a cancel for a job that worker runs."""
        job_id, _, worker = data[2:].decode().partition(" ")
        if worker != self.id:
            return  # another worker's job (every worker hears every shard)
        r = self.state.running.get(job_id)
        if r is None:
            self.launcher.cancel_when_started(job_id)  # its claim reply may be on its way
            return
        if not r.ctx.cancel_requested:
            log.info("event=cancel_requested worker=%s job=%s via=push", self.id, job_id)
            deliver_cancel(r.ctx, r.task, r.handle)

    def stop(self) -> None:
        self._stop.set()
        self.state.progress.set()

    async def run(self) -> None:
        """Beat until ``stop``, also while the worker drains: jobs finishing within the
        shutdown grace still need their leases extended."""
        progress = self.state.progress
        interval = self.state.settings.lease_seconds / 3
        next_beat = time.monotonic() + interval
        chores: asyncio.Task[None] | None = None
        try:
            while not self._stop.is_set():
                await wait_for(progress, next_beat - time.monotonic())
                if self._stop.is_set():
                    return
                full = time.monotonic() >= next_beat
                progress.clear()
                try:
                    await self._beat(progress_only=not full)
                    failed = False
                except FAULTS as exc:
                    log.warning("event=heartbeat_failed worker=%s error=%r", self.id, exc)
                    failed = True
                if full:
                    next_beat = time.monotonic() + (1.0 if failed else interval)
                    # beside the beats, failed or not: a master failing over must neither
                    # keep this worker from saying it is alive elsewhere, nor hold up the
                    # beats with the client's retries of a call to it
                    if chores is not None and chores.done():
                        ended, chores = chores, None
                        ended.result()  # a defect of ours in it surfaces here, as in a beat
                    if chores is None or chores.done():
                        chores = asyncio.create_task(self._chores())
                if not full:  # merge bursts of progress reports
                    await wait_for(self._stop, self.progress_interval)
        finally:
            await stop_task(chores, "worker advertisement")

    async def _chores(self) -> None:
        """Advertise this worker and refresh its queues' limits, each on its own."""
        for step in (self.advertise, self.claimer.refresh_limits):
            try:
                await step()
            except FAULTS as exc:
                log.warning(
                    "event=heartbeat_failed worker=%s step=%s error=%r",
                    self.id,
                    step.__name__,
                    exc,
                )

    async def _beat(self, progress_only: bool) -> None:
        by_shard: dict[int, list[tuple[str, int, bytes]]] = defaultdict(list)
        lines_by_shard: dict[int, list[tuple[str, int, list[bytes]]]] = defaultdict(list)
        beating = []
        state = self.state
        for r in list(state.running.values()):
            if r.logged:
                r.logged = False
                lines = r.ctx._take_logs()
                if lines:
                    lines_by_shard[r.shard].append((r.job.id, self._lines_ttl, lines))
            if progress_only and r.progress is None:
                continue
            by_shard[r.shard].append((r.job.id, r.job.lease_version, r.progress or b""))
            beating.append(r)
            r.progress = None
        if not by_shard and not lines_by_shard:
            return
        calls = [
            heartbeat_call(shard, self.id, state.lease_ms, items, state.history_ms)
            for shard, items in by_shard.items()
        ]
        permits: dict[str, list[str]] = defaultdict(list)
        if not progress_only:
            for r in beating:
                if r.permit is not None:
                    permits[r.job.queue].append(r.permit)
        beats = len(calls)
        calls += limit_calls(state.keys, "extend", permits, state.lease_ms)
        # log lines ride along; lost if their call fails (they are a debugging aid, and the
        # lease, which matters, is retried at the next beat)
        calls += [joblog_call(shard, LOG_LINES, items) for shard, items in lines_by_shard.items()]
        state.beat_idle.clear()
        try:
            # one pipeline per node, each call's reply on its own: a node that is down (a
            # master failing over) fails its shards' calls only, the others' replies are used
            replies = await state.scripts.call_many_each(calls)
        except FAULTS as exc:
            replies = [exc] * len(calls)
        finally:
            state.beat_idle.set()
        index = {r.job.id: r for r in beating}
        for items, reply in zip(by_shard.values(), replies[:beats], strict=True):
            if isinstance(reply, Exception):
                # its node is down: these leases are retried at the next beat, with the
                # progress they carried unless the task has reported newer since
                for job_id, _, carried in items:
                    r = index[job_id]
                    if carried and r.progress is None:
                        r.progress = carried
                continue
            for (job_id, _, _), (code, cancel) in zip(items, parse_pairs(reply), strict=True):
                r = index[job_id]
                if code is not Code.OK:
                    state.stats.leases_lost += 1
                    log.warning(
                        "event=lease_lost worker=%s job=%s code=%s: stopping it, its outcome will be dropped",
                        self.id,
                        job_id,
                        code.name,
                    )
                    r.lost = True
                    if r.handle is not None:
                        r.handle.cancel()
                elif cancel and not r.ctx.cancel_requested:
                    log.info(
                        "event=cancel_requested worker=%s job=%s via=heartbeat", self.id, job_id
                    )
                    deliver_cancel(r.ctx, r.task, r.handle)
        failed = next((reply for reply in replies if isinstance(reply, Exception)), None)
        if failed is not None:  # after the others' replies: run() logs it and tries again
            if isinstance(failed, FAULTS):
                raise failed
            raise RedisError(f"a heartbeat call failed: {failed!r}") from failed

    async def advertise(self) -> None:
        """Say this worker is alive (``QueueAdmin.live_workers``), and publish its tasks."""
        state = self.state
        info = encode_json(
            {
                "id": self.id,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "concurrency": state.concurrency,
                "running": len(state.running),
                "tasks": state.registry.names(),
                "queues": state.queues,
                "seen_at": time.time(),
            }
        )
        await state.redis.hset(state.keys.workers(), self.id, info)
        # the tasks it runs, with their policies and payload schemas (engine/catalog.py): what
        # the API checks and completes a submit with
        ads = [t.ad(self.id) for t in state.registry]
        await publish_tasks(state.redis, state.keys, ads)
