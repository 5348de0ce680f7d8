"""The worker's side of ``ctx.checkpoint``: one heartbeat of the job carrying its state.

Saved as a beat of its own rather than at the next periodic beat: the task awaits the save,
and learns at once whether the state is kept. A refusal (the lease was lost) stops the
attempt, as a refused periodic beat does (heartbeat.py).
"""

from __future__ import annotations

import logging

from jobtier.core.errors import Code
from jobtier.core.sealing import PREFIX
from jobtier.store.calls import heartbeat_call, parse_pairs
from jobtier.worker.attempt import deliver_cancel
from jobtier.worker.checkpoint import CheckpointRefused, check_size
from jobtier.worker.job_context import JobContext
from jobtier.worker.state import WorkerState

log = logging.getLogger("jobtier.worker")


class CheckpointSaver:
    """Saves the checkpoints of a worker's running jobs (``save``: a context's ``Saver``)."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.limit = state.settings.checkpoint_max_bytes
        self.keyring = state.store.keyring
        self.sealed_queues = state.settings.encrypted_queue_names()

    async def save(self, ctx: JobContext, data: bytes) -> None:
        check_size(data, self.limit)
        state, job = self.state, ctx.job
        r = state.running.get(job.id)
        if r is None or r.lost or r.released:
            raise CheckpointRefused(f"job {job.id} is no longer held by worker {state.id}")
        # an encrypted job's state is sealed as its result is (attempt.py): no plaintext
        # byte of it reaches Redis, the transition log or Postgres (docs/encryption.md)
        keyring = self.keyring
        if keyring is not None and (
            (r.task is not None and r.task.encrypt)
            or job.queue in self.sealed_queues
            or job.payload[: len(PREFIX)] == PREFIX
        ):
            data = keyring.seal(job.id, "checkpoint", data)
        # a progress report not sent yet rides along (the beat would carry it anyway)
        progress, r.progress = r.progress or b"", None
        call = heartbeat_call(
            ctx.shard,
            state.id,
            state.lease_ms,
            [(job.id, job.lease_version, progress)],
            state.history_ms,
            [(0, data)],
        )
        ((code, cancel),) = parse_pairs(await state.scripts.call(*call))
        if code is not Code.OK:
            state.stats.leases_lost += 1
            log.warning(
                "event=lease_lost worker=%s job=%s code=%s via=checkpoint: stopping it",
                state.id,
                job.id,
                code.name,
            )
            r.lost = True
            if r.handle is not None:
                r.handle.cancel()
            raise CheckpointRefused(f"job {job.id} was taken back from worker {state.id}")
        state.stats.checkpoints += 1
        if cancel and not ctx.cancel_requested:
            deliver_cancel(ctx, r.task, r.handle)
