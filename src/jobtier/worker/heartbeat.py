"""The heartbeat: lease renewal, progress and log lines, and cancel requests.

Every third of the lease the heartbeat extends the leases of all running jobs (and the
permits of limited queues' jobs) in one pipeline, advertises the worker and re-reads which
of its queues are limited. Between full beats, a progress beat (at most every
``progress_interval``) carries the progress reports and log lines the tasks made. A refused
beat means the lease was lost (it expired and the job moved on): the task is stopped and its
outcome dropped.

A cancel request reaches the worker sooner than a heartbeat: ``cancel.lua`` publishes
``x <job id> <worker id>`` on the shard's wake channel, which every worker already listens
to, and the worker named there stops the task at once (``_on_cancel_push``). Pub/sub can
drop a message (a reconnect); the heartbeat, which reports the request too, is the safety
net. The push may overtake the claim reply on the command connection: a push for a job not
(yet) running is kept (``EARLY_CANCELS`` at most) for ``_start`` to deliver.

The loop is stopped by a flag, not by cancelling it: a cancellation landing inside the Redis
client during a beat was seen to be swallowed there, and the loop went on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import defaultdict

from redis.exceptions import RedisError

from jobtier.core.errors import Code
from jobtier.core.model import encode_json
from jobtier.engine.catalog import publish as publish_tasks
from jobtier.store.calls import heartbeat_call, joblog_call, parse_pairs
from jobtier.worker.attempt import deliver_cancel
from jobtier.worker.claiming import Claiming
from jobtier.worker.context import LOG_LINES
from jobtier.worker.permits import limit_calls

log = logging.getLogger("jobtier.worker")

EARLY_CANCELS = 1000  # cancel pushes kept for jobs whose claim reply has not arrived yet


class Heartbeat(Claiming):
    """The worker's heartbeat and cancel requests (see the module docstring)."""

    def _on_cancel_push(self, data: bytes) -> None:
        job_id, _, worker = data[2:].decode().partition(" ")
        if worker != self.id:
            return  # another worker's job (every worker hears every shard)
        r = self._running.get(job_id)
        if r is None:
            # its claim reply may still be on its way: _start delivers it then
            self._early_cancels[job_id] = None
            if len(self._early_cancels) > EARLY_CANCELS:
                del self._early_cancels[next(iter(self._early_cancels))]
            return
        if not r.ctx.cancel_requested:
            log.info("event=cancel_requested worker=%s job=%s via=push", self.id, job_id)
            deliver_cancel(r.ctx, r.task, r.handle)

    # --- heartbeats -------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        # Runs until cancelled, also while stopping: jobs finishing within the shutdown grace
        # still need their leases extended.
        interval = self.settings.lease_seconds / 3
        next_beat = time.monotonic() + interval
        while not self._heart_stop.is_set():
            timeout = next_beat - time.monotonic()
            if timeout > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._progress.wait()
            if self._heart_stop.is_set():
                return
            full = time.monotonic() >= next_beat
            self._progress.clear()
            try:
                await self._beat(progress_only=not full)
                if full:
                    next_beat = time.monotonic() + interval
                    await self._advertise()
                    await self._refresh_limits()
            except (RedisError, OSError) as exc:
                log.warning("event=heartbeat_failed worker=%s error=%r", self.id, exc)
                if full:
                    next_beat = time.monotonic() + 1.0
            if not full:  # merge bursts of progress reports
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.progress_interval):
                        await self._heart_stop.wait()

    async def _beat(self, progress_only: bool) -> None:
        by_shard: dict[int, list[tuple[str, int, bytes]]] = defaultdict(list)
        lines_by_shard: dict[int, list[tuple[str, int, list[bytes]]]] = defaultdict(list)
        beating = []
        for r in list(self._running.values()):
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
            heartbeat_call(shard, self.id, self.lease_ms, items, self.history_ms)
            for shard, items in by_shard.items()
        ]
        permits: dict[str, list[str]] = defaultdict(list)
        if not progress_only:
            for r in beating:
                if r.permit is not None:
                    permits[r.job.queue].append(r.permit)
        beats = len(calls)
        calls += limit_calls(self.scripts, self.keys, "extend", permits, self.lease_ms)
        # log lines ride along; lost if this beat fails (they are a debugging aid, and the
        # lease, which matters, is retried at the next beat)
        calls += [joblog_call(shard, LOG_LINES, items) for shard, items in lines_by_shard.items()]
        self._beat_idle.clear()
        try:
            replies = (await self.scripts.call_many(calls))[:beats]
        finally:
            self._beat_idle.set()
        index = {r.job.id: r for r in beating}
        for items, reply in zip(by_shard.values(), replies, strict=True):
            for (job_id, _, _), (code, cancel) in zip(items, parse_pairs(reply), strict=True):
                r = index[job_id]
                if code is not Code.OK:
                    self.stats.leases_lost += 1
                    log.warning(
                        "event=lease_lost worker=%s job=%s code=%s: stopping it, its outcome will be dropped",
                        self.id, job_id, code.name,
                    )  # fmt: skip
                    r.lost = True
                    if r.handle is not None:
                        r.handle.cancel()
                elif cancel and not r.ctx.cancel_requested:
                    log.info(
                        "event=cancel_requested worker=%s job=%s via=heartbeat", self.id, job_id
                    )
                    deliver_cancel(r.ctx, r.task, r.handle)

    async def _advertise(self) -> None:
        info = encode_json(
            {
                "id": self.id,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "concurrency": self.concurrency,
                "running": len(self._running),
                "tasks": self.registry.names(),
                "queues": self.queues,
                "seen_at": time.time(),
            }
        )
        await self.queue.redis.hset(self.keys.workers(), self.id, info)
        # the tasks it runs, with their policies and payload schemas (engine/catalog.py): what the
        # API checks and completes a submit with
        await publish_tasks(self.queue.redis, self.keys, [t.ad(self.id) for t in self.registry])
