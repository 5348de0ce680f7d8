"""A task's checkpoint (``ctx.checkpoint``): the progress it saves to resume from.

``await ctx.checkpoint(state)`` saves ``state`` (any JSON value) under the job's lease: one
heartbeat of that job alone (heartbeat.lua), so the lease is extended in the same atomic
step, and a worker that lost the job cannot overwrite the state its successor saves. The
next attempt of the job (a retry, or a reclaim after its worker died) is handed the last
state saved by its claim (claim.lua) as ``ctx.checkpoint.state``.

The state is bounded (``JOBTIER_CHECKPOINT_MAX_BYTES``): it lives in the job's hash in Redis
and in Postgres with the transition that saved it (``job_checkpoints``), not in a blob store.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from jobtier.core.errors import Fatal
from jobtier.core.model import encode_json
from jobtier.core.sealing import unseal

# saves a checkpoint of the job of a context (a JobContext: not imported here, which imports
# this), its state encoded; the worker's is CheckpointSaver.save
Saver = Callable[[Any, bytes], Awaitable[None]]


class CheckpointTooLarge(Fatal, ValueError):
    """The state given to ``ctx.checkpoint`` is over ``JOBTIER_CHECKPOINT_MAX_BYTES`` as JSON.
    Raised into the task; uncaught, the job fails without a retry (none would make it fit)."""


def check_size(data: bytes, limit: int) -> None:
    """Raise ``CheckpointTooLarge`` when ``data`` (a state as JSON) is over ``limit`` bytes."""
    if len(data) > limit:
        raise CheckpointTooLarge(
            f"checkpoint state is {len(data)} bytes as JSON; the limit is {limit} "
            "(JOBTIER_CHECKPOINT_MAX_BYTES)"
        )


class CheckpointRefused(RuntimeError):
    """The worker no longer holds the job (its lease expired and it moved on): nothing was
    saved, and the attempt is being stopped, its outcome dropped."""


class Checkpoint:
    """``ctx.checkpoint``: call it to save, read ``state`` for the last state saved."""

    __slots__ = ("_ctx", "_data", "_decoded", "_resumed", "saves")

    def __init__(self, ctx: Any, data: bytes | None) -> None:
        self._ctx = ctx
        self._data = data
        self._decoded = False
        self._resumed = data is not None
        self.saves = 0  # by this attempt

    @property
    def state(self) -> Any:
        """The last state saved: by this attempt once it saved one, else by an earlier
        attempt of the job (what a retried or reclaimed attempt resumes from); None when
        none was ever saved."""
        if self._data is None:
            return None
        # an encrypted job's saved state comes sealed (checkpoint_saver.py)
        data = unseal(
            getattr(self._ctx, "_keyring", None), self._ctx.job.id, "checkpoint", self._data
        )
        return msgspec.json.decode(data)

    @property
    def resumed(self) -> bool:
        """True when this attempt started from a state an earlier attempt saved."""
        return self._resumed

    def __call__(self, state: Any) -> Awaitable[None]:
        """Save ``state`` (any JSON value); ``await`` it from an ``async`` task: it returns
        once Redis holds it. ``CheckpointTooLarge`` over the limit, ``TypeError`` for a value
        that is not JSON, ``CheckpointRefused`` when the worker lost the job, a Redis error
        when Redis cannot be reached (nothing saved: the task may go on, or raise it)."""
        ctx = self._ctx
        if threading.get_ident() != ctx._loop_thread:
            raise RuntimeError(
                "ctx.checkpoint() saves on the worker's event loop: await it from an async task"
            )
        try:
            data = encode_json(state)
        except (TypeError, msgspec.EncodeError) as exc:
            raise TypeError(f"checkpoint state is not JSON-serialisable: {exc}") from None
        return self._save(data)

    async def _save(self, data: bytes) -> None:
        saver = self._ctx._on_checkpoint
        if saver is not None:
            await saver(self._ctx, data)
        self._data = data
        self.saves += 1
