"""The scaling read of a queue (``GET /v1/admin/queues/{name}/scaling``): the operation both
clients drive (``_core``'s style, kept here: ``_core`` is at the size a module may have)."""

from __future__ import annotations

import msgspec

from jobtier.client._core import Call, Op, fetch, path, query
from jobtier.core.model import QueueScaling

scaling_decoder = msgspec.json.Decoder(QueueScaling)


def queue_scaling_op(
    name: str,
    slots: int | None,
    min: int | None,
    max: int | None,
    target_age: float | None,
) -> Op[QueueScaling]:
    params = query(slots=slots, min=min, max=max, target_age=target_age)
    call = Call("GET", path("/v1/admin/queues", name, "/scaling"), params=params)
    return (yield from fetch(call, scaling_decoder, "a scaling answer"))
