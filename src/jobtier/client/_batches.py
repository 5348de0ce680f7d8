"""Batches over HTTP (``/v1/batches``): the operations both clients drive (``_core``'s style,
kept here: ``_core`` is at the size a module may have)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from jobtier.client._core import Call, Op, fetch, json_call, path, present
from jobtier.core.batch_model import BatchCallback, BatchChanged, BatchStatus

status_decoder = msgspec.json.Decoder(BatchStatus)
changed_decoder = msgspec.json.Decoder(BatchChanged)


def submit_batch_op(
    type: str,
    items: Sequence[Any],
    chunk_size: int | None,
    priority: str,
    queue: str | None,
    max_attempts: int | None,
    callback: BatchCallback | None,
    idempotency_key: str | None = None,
) -> Op[BatchStatus]:
    body = present(
        type=type,
        items=list(items),
        chunk_size=chunk_size,
        priority=priority,
        queue=queue,
        max_attempts=max_attempts,
        callback=callback,
        idempotency_key=idempotency_key,
    )
    call = json_call("POST", "/v1/batches", body)
    return (yield from fetch(call, status_decoder, "a batch"))


def batch_op(batch_id: str) -> Op[BatchStatus]:
    call = Call("GET", path("/v1/batches", batch_id))
    return (yield from fetch(call, status_decoder, "a batch"))


def batch_action_op(batch_id: str, action: str) -> Op[BatchChanged]:
    call = Call("POST", path("/v1/batches", batch_id, f"/{action}"))
    return (yield from fetch(call, changed_decoder, f"a batch {action}"))
