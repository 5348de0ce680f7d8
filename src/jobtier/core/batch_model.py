"""Batches: many jobs of one task submitted as one, counted together (``docs/batches.md``).

``BatchSpec`` is the body of ``POST /v1/batches`` (and what ``submit_batch`` builds);
``BatchStatus`` the status document of a batch, its counts summed from every shard.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from jobtier.core.errors import JobtierError
from jobtier.core.model import CallbackSpec

MAX_BATCH_CHILDREN = 100_000  # children of one batch (one request)
MAX_BATCH_ITEMS = 1_000_000  # items of one request, when chunk_size groups them


class BatchCallback(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The job created once every child has finished: its payload is ``{"batch_id", "total",
    "succeeded", "failed", "cancelled", "payload"}``, ``payload`` this one's. ``webhook``: its
    own webhook (the batch's: the callback job is created when the batch finishes)."""

    type: str
    payload: Any = None
    queue: str | None = None
    max_attempts: int | None = None
    webhook: CallbackSpec | None = None


class BatchSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A batch: one child job of ``type`` per item of ``items`` or, with ``chunk_size``, per
    ``chunk_size`` items of it (the child's payload is then ``{"offset", "items"}``)."""

    type: str
    items: list[Any]
    chunk_size: int | None = None
    priority: str = "normal"
    queue: str | None = None
    max_attempts: int | None = None
    callback: BatchCallback | None = None
    # a repeat (same tenant and key, same request) answers with the batch the first made,
    # even one whose submit broke off part-way: a client may retry a failed submit safely
    idempotency_key: str | None = None


class BatchStatus(msgspec.Struct, kw_only=True):
    """A batch's status document: ``state`` ``running`` until every child has finished
    (``finished``; ``running`` again while a retry runs); the counts, summed over the shards
    as they are now."""

    id: str
    state: Literal["running", "finished"]
    type: str
    queue: str
    total: int
    pending: int
    succeeded: int
    failed: int
    cancelled: int
    cancel_requested: bool
    created_at_ms: int
    finished_at_ms: int | None = None
    callback_job: str | None = None


class BatchChanged(msgspec.Struct, kw_only=True):
    """What a cancel or a retry of a batch did: ``changed`` children cancelled (or retried),
    ``requested`` running children told to stop (cancel), and the batch after."""

    changed: int
    requested: int = 0
    batch: BatchStatus


class BatchNotFound(JobtierError, LookupError):
    def __init__(self, batch_id: str) -> None:
        super().__init__(f"batch {batch_id} not found")
        self.batch_id = batch_id
