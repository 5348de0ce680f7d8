"""``checkpoint``: the last state a job saved with ``ctx.checkpoint`` (``GET
/v1/jobs/{id}/checkpoint``), an operation of both clients (``_core`` holds the rest)."""

from __future__ import annotations

import msgspec

from jobtier.client._core import Call, Op, fetch, job_path
from jobtier.core.model import SavedCheckpoint

checkpoint_decoder = msgspec.json.Decoder(SavedCheckpoint)


def checkpoint_op(job_id: str) -> Op[SavedCheckpoint]:
    call = Call("GET", job_path(job_id, "/checkpoint"))
    return (yield from fetch(call, checkpoint_decoder, "a checkpoint", job_id))
