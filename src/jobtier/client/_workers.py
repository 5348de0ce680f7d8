"""The live workers (``GET /v1/admin/workers``): the operation both clients drive (``_core``'s
style, kept here: ``_core`` is at the size a module may have)."""

from __future__ import annotations

import msgspec

from jobtier.client._core import Call, Op, fetch
from jobtier.core.worker_list import WorkerList

workers_decoder = msgspec.json.Decoder(WorkerList)


def workers_op() -> Op[WorkerList]:
    call = Call("GET", "/v1/admin/workers")
    return (yield from fetch(call, workers_decoder, "a worker list"))
