"""Batches for producers: check one, submit it, read, cancel and retry it
(``Queue.batches``; the Redis side is ``flows/batches.py``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from jobtier.core.batch_model import (
    MAX_BATCH_CHILDREN,
    MAX_BATCH_ITEMS,
    BatchCallback,
    BatchChanged,
    BatchSpec,
    BatchStatus,
)
from jobtier.core.errors import InvalidRequest, PayloadTooLarge
from jobtier.core.model import CallbackSpec, JobSpec, encode_json
from jobtier.engine.produce import DEFAULT_TENANT, Producer, Registrar
from jobtier.engine.validate import check_key
from jobtier.flows import batches as store_batches
from jobtier.flows.batches import PreparedBatch
from jobtier.store.context import Store


def _chunked(items: list[Any], size: int | None) -> list[Any]:
    if size is None:
        return items
    if isinstance(size, bool) or not 1 <= size <= MAX_BATCH_ITEMS:
        raise InvalidRequest(
            f"chunk_size must be an integer from 1 to {MAX_BATCH_ITEMS}", field="chunk_size"
        )
    return [
        {"offset": start, "items": items[start : start + size]}
        for start in range(0, len(items), size)
    ]


def _refused(exc: InvalidRequest, index: int, spec: BatchSpec) -> InvalidRequest:
    """A child's payload refused by its task's check, said of what the request sent: an item
    (``items[i]``), or with ``chunk_size`` the shape every child gets, which the task's
    payload type must accept."""
    if spec.chunk_size is None or not (exc.field or "").startswith("payload."):
        return type(exc)(f"items[{index}]: {exc}", field="items")  # (a size: the chunk's)
    return type(exc)(
        f'with chunk_size each child\'s payload is {{"offset": …, "items": [...]}}, which the '
        f"payload type of task {spec.type!r} refuses (child {index}: {exc}); give the task "
        "a payload type of that shape, or leave chunk_size out",
        field="chunk_size",
    )


class BatchControl:
    """Batches of one deployment; ``producer`` checks their jobs as it checks any submit."""

    def __init__(self, store: Store, producer: Producer) -> None:
        self.store = store
        self.producer = producer

    async def prepare(self, spec: BatchSpec, tenant: str) -> PreparedBatch:
        """Check ``spec`` (``InvalidRequest`` naming the member, ``items[i]`` for a child's
        payload) and encode its children; nothing is written."""
        if len(spec.items) > MAX_BATCH_ITEMS:
            raise PayloadTooLarge(f"at most {MAX_BATCH_ITEMS} items per batch", field="items")
        payloads = _chunked(spec.items, spec.chunk_size)
        if not payloads:
            raise InvalidRequest("a batch needs at least one item", field="items")
        if len(payloads) > MAX_BATCH_CHILDREN:
            raise PayloadTooLarge(
                f"{len(payloads)} children; at most {MAX_BATCH_CHILDREN} per batch (a "
                "larger chunk_size makes fewer)",
                field="items",
            )
        producer = self.producer
        await producer.ensure_known([spec.type] + ([spec.callback.type] if spec.callback else []))
        first = JobSpec(
            type=spec.type,
            payload=payloads[0],
            priority=spec.priority,  # type: ignore[arg-type]  # checked by prepare()
            queue=spec.queue,
            max_attempts=spec.max_attempts,
        )
        try:
            template = producer.prepare(first, tenant)
        except InvalidRequest as exc:
            field = exc.field or ""
            if field != "payload" and not field.startswith("payload."):
                raise
            raise _refused(exc, 0, spec) from None
        task = producer._task_info(spec.type)
        limit = self.store.settings.max_payload_bytes
        keys = self.store.keys
        batch_id = store_batches.new_batch_id(keys)
        ids = store_batches.child_ids(keys, batch_id, len(payloads))
        children: list[tuple[str, bytes]] = []
        digest = hashlib.blake2b(digest_size=16) if spec.idempotency_key is not None else None
        for index, item in enumerate(payloads):
            try:
                payload = encode_json(item)
            except TypeError as exc:
                raise InvalidRequest(f"items[{index}]: {exc}", field="items") from None
            if len(payload) > limit:
                raise PayloadTooLarge(
                    f"items[{index}]: the payload is {len(payload)} bytes; the limit is {limit} "
                    "(JOBTIER_MAX_PAYLOAD_BYTES)",
                    field="items",
                )
            if task is not None and index:
                try:
                    task.validate(item)
                except InvalidRequest as exc:
                    raise _refused(exc, index, spec) from None
            job_id = ids[index]
            if digest is not None:  # of the payload as given: a sealed one differs each time
                digest.update(len(payload).to_bytes(4, "big"))
                digest.update(payload)
            if template.seal is not None:
                payload = template.seal(job_id, payload)
            children.append((job_id, payload))
        prepared = PreparedBatch(
            batch_id,
            tenant,
            spec.type,
            template.queue,
            template.priority,
            template.max_attempts,
            children,
        )
        if spec.callback is not None:
            self._with_callback(prepared, spec.callback)
        if digest is not None:
            prepared.idempotency_key = check_key(spec.idempotency_key, "idempotency_key")
            head = (prepared.type, prepared.queue, prepared.priority, prepared.max_attempts)
            digest.update(repr((*head, prepared.callback)).encode())
            digest.update(prepared.callback_payload)
            prepared.digest = digest.hexdigest()
        return prepared

    def _with_callback(self, prepared: PreparedBatch, cb: BatchCallback) -> None:
        # checked as the task will get it: the batch's summary around the payload given
        summary = {"batch_id": prepared.batch_id, "total": 0, "succeeded": 0, "failed": 0}
        summary |= {"cancelled": 0, "payload": cb.payload}
        spec = JobSpec(type=cb.type, payload=summary, queue=cb.queue, max_attempts=cb.max_attempts)
        try:
            item = self.producer.prepare(spec, prepared.tenant)
        except InvalidRequest as exc:
            field = f"callback.{exc.field}" if exc.field else "callback"
            raise type(exc)(f"callback: {exc}", field=field) from None
        if item.seal is not None:
            # the callback's payload is written by a script, which cannot encrypt it
            raise InvalidRequest(
                f"callback task {cb.type!r} has encrypted payloads; a batch's callback cannot",
                field="callback.type",
            )
        keys = self.store.keys
        prepared.callback = f"{cb.type} {item.queue} {item.max_attempts}"
        prepared.callback_id = keys.new_id(keys.shard_of(prepared.batch_id))
        prepared.callback_payload = encode_json(cb.payload)

    async def submit_prepared(
        self,
        prepared: PreparedBatch,
        webhook: CallbackSpec | None = None,
        registrar: Registrar | None = None,
    ) -> BatchStatus:
        """Create the batch (``webhook`` written first, through ``registrar`` or the
        producer's, keyed by the callback job's id)."""
        if webhook is None:
            return await store_batches.submit_batch(self.store, prepared)
        ours = [(prepared.callback_id, webhook, "callback.webhook.")]
        return await self.producer._with_callbacks(
            registrar,
            prepared.tenant,
            ours,
            lambda: store_batches.submit_batch(self.store, prepared),
            lambda _: {prepared.callback_id},  # made later, when the batch finishes
        )

    async def submit(
        self,
        type: str,
        items: Sequence[Any],
        *,
        chunk_size: int | None = None,
        priority: str = "normal",
        queue: str | None = None,
        max_attempts: int | None = None,
        callback: BatchCallback | None = None,
        tenant: str = DEFAULT_TENANT,
        idempotency_key: str | None = None,
    ) -> BatchStatus:
        """Submit a batch: one child of ``type`` per item (or per ``chunk_size`` items), and
        ``callback`` created when all have finished (with its webhook, if it has one). A
        repeated ``idempotency_key`` with the same request returns the first batch's status.
        Returns its status."""
        spec = BatchSpec(
            type=type,
            items=list(items),
            chunk_size=chunk_size,
            priority=priority,
            queue=queue,
            max_attempts=max_attempts,
            callback=callback,
            idempotency_key=idempotency_key,
        )
        hook = callback.webhook if callback is not None else None
        return await self.submit_prepared(await self.prepare(spec, tenant), hook)

    async def status(self, batch_id: str, tenant: str | None = None) -> BatchStatus:
        """The batch's status; ``BatchNotFound`` for an unknown one (or another tenant's)."""
        return await store_batches.read_batch(self.store, batch_id, tenant)

    async def cancel(self, batch_id: str, tenant: str | None = None) -> BatchChanged:
        """Cancel its children that have not started, ask its running ones to stop."""
        done, asked = await store_batches.cancel_batch(self.store, batch_id, tenant)
        return BatchChanged(
            changed=done, requested=asked, batch=await self.status(batch_id, tenant)
        )

    async def retry(self, batch_id: str, tenant: str | None = None) -> BatchChanged:
        """Send its failed children back to their queue, attempts reset."""
        done = await store_batches.retry_batch(self.store, batch_id, tenant)
        return BatchChanged(changed=done, batch=await self.status(batch_id, tenant))
