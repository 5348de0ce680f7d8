"""Batches in Redis: children created in bulk, counted per shard, finished by one hand-off
per shard (``docs/batches.md``).

Ids: a batch's id is ``<time><8 random digits>00000000-<shard>`` and its i-th child's the
same 18 characters, then i + 1 in 8 digits, then its shard (the shards taken in turn from the
batch's): a child's id names its batch's share of the counts (``bt:<those 18>``) with no
field to store or read, and cancel and retry find every child without a list of them.

Keys (``core/keys.py`` tags them like any shard key):

* ``jt:{b}:batch:<id>``, in the batch's shard ``b``: the record (tenant, total, the shards
  its children live in, how many of them are still ``open``, the callback, each shard's last
  hand-off);
* ``jt:{s}:bt:<first 18 characters of the id>`` in each shard ``s`` holding children: their
  counts there (``n``, ``left``, ``s``/``f``/``c`` by final state), moved by the transition
  scripts themselves (lib.lua ``batch_finished``), so a child's count changes in the same
  atomic step as its state, on its own shard, with no message per child.

Why per-shard counters rather than one counter beside the record: the record's slot is on
one Cluster node, and a child finishing elsewhere cannot touch it in its script. Sending
each finish there through the flow stream (as flows do for dependents) would cost an XADD,
a resolver read and a script call per child; instead a shard hands off once, when its last
child finishes, and readers sum the shards (one HMGET per shard, pipelined).

A submit runs in three steps: the record and a hold (``hold``, and +1 on ``left``) in each
shard it will use; the children (``batch_submit.lua``, in rounds of ``ROUND``: one pipeline
per round, one call per shard); then the holds released (``batch_seal.lua``) and the record
marked ``sealed``. The hold keeps a shard whose first children finish before the rest are
added from calling its share done. A submitter that dies before the last step leaves the
batch running until it is cancelled (the children it made run): ``batch_cancel.lua`` counts
the children not made as cancelled, stops a submit still running from making them, and
releases the holds itself (each is released once, by whichever comes first).

With an idempotency key, ``jt:{k}:bidem:<tenant>:<key>`` (``k`` from the tenant and key)
holds ``"<batch id> <digest of the request>"`` for ``idempotency_ttl_seconds``: a repeat
answers with that batch, even one whose submit broke off (so a client can retry, then
cancel it).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from jobtier.core.batch_model import BatchNotFound, BatchStatus
from jobtier.core.errors import IdempotencyConflict
from jobtier.core.keys import Keys
from jobtier.runtime import tracing
from jobtier.store.calls import Call
from jobtier.store.context import Store

ROUND = 8000  # children per pipeline of batch_submit.lua calls (one call per shard)
SCAN_CHUNK = 2000  # children per batch_cancel / batch_retry call


PREFIX = 18  # characters a batch's id and its children's share: its time and 8 random digits
_DIGITS = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford's base32, as ULIDs spell


def new_batch_id(keys: Keys) -> str:
    """A batch id in a random shard: a fresh ULID's first 18 characters, then 8 zeros."""
    job_id = keys.new_id()
    return f"{job_id[:PREFIX]}00000000-{keys.shard_of(job_id)}"


def _index(n: int) -> str:
    out = []
    for _ in range(8):
        n, d = divmod(n, 32)
        out.append(_DIGITS[d])
    return "".join(reversed(out))


def child_ids(keys: Keys, batch_id: str, count: int) -> list[str]:
    """The ids of the batch's first ``count`` children, in order; the shards in turn from
    the one after the batch's."""
    prefix, first = batch_id[:PREFIX], keys.shard_of(batch_id)
    shards = keys.shards
    return [f"{prefix}{_index(i)}-{(first + i) % shards}" for i in range(1, count + 1)]


@dataclass(slots=True)
class PreparedBatch:
    """A batch checked and its children's payloads encoded (``BatchControl.prepare``)."""

    batch_id: str
    tenant: str
    type: str
    queue: str
    priority: str
    max_attempts: int
    children: list[tuple[str, bytes]]  # (job id, payload as sent)
    callback: str = ""  # "<type> <queue> <attempts>" of the callback job ('': none)
    callback_id: str = ""  # the id its callback job gets (drawn now: its webhook is keyed so)
    callback_payload: bytes = b""
    idempotency_key: str = ""  # '' none
    digest: str = ""  # of the request, to tell a repeat from another use of the key


def record_key(store: Store, batch_id: str) -> str:
    return f"{store.keys.base(store.keys.shard_of(batch_id))}batch:{batch_id}"


def _counts_key(store: Store, shard: int, batch_id: str) -> str:
    return f"{store.keys.base(shard)}bt:{batch_id[:PREFIX]}"


def _idempotency_key(store: Store, tenant: str, key: str) -> str:
    keys = store.keys
    return f"{keys.base(keys.shard_for(tenant, key))}bidem:{tenant}:{key}"


async def _first_with_key(store: Store, batch: PreparedBatch) -> str | None:
    """Claim the batch's idempotency key for it: None, or the id of the batch that has it
    (``IdempotencyConflict`` if that one was another request)."""
    key = _idempotency_key(store, batch.tenant, batch.idempotency_key)
    mine = f"{batch.batch_id} {batch.digest}"
    ttl = store.settings.idempotency_ttl_seconds
    if await store.redis.set(key, mine, nx=True, ex=ttl):
        # a durable submit (store/durable.py): the key's node may hold none of the batch's
        # writes, whose WAITs would then not cover it; lost, a retry would make a second batch
        await store.scripts.confirm([store.keys.shard_for(batch.tenant, batch.idempotency_key)])
        return None
    held = cast(bytes | None, await store.redis.get(key))
    first, _, digest = (held or b"").decode().partition(" ")
    if not first:  # expired between the two calls: ours now
        await store.redis.set(key, mine, ex=ttl)
        return None
    if digest != batch.digest:
        raise IdempotencyConflict(batch.idempotency_key, first)
    return first


async def submit_batch(store: Store, batch: PreparedBatch) -> BatchStatus:
    """Create the batch by the module's three steps; its status after them. With an
    idempotency key another submit already used for the same request: that batch's status
    (``BatchNotFound`` if it is no longer kept)."""
    if batch.idempotency_key and (first := await _first_with_key(store, batch)):
        return await read_batch(store, first, batch.tenant)
    keys = store.keys
    by_shard: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
    for child in batch.children:
        by_shard[keys.shard_of(child[0])].append(child)
    trace = tracing.traceparent()
    record = record_key(store, batch.batch_id)
    pipe = store.redis.pipeline(transaction=False)
    pipe.hset(
        record,
        mapping={
            "tenant": batch.tenant,
            "type": batch.type,
            "queue": batch.queue,
            "prio": batch.priority,
            "total": len(batch.children),
            "shards": " ".join(map(str, sorted(by_shard))),
            "open": len(by_shard),
            "state": "running",
            "created": int(time.time() * 1000),
            "cb": batch.callback,
            "cbid": batch.callback_id,
            "cbp": batch.callback_payload,
            "tp": trace,
        },
    )
    for shard in by_shard:
        counts = _counts_key(store, shard, batch.batch_id)
        pipe.hset(counts, mapping={"bid": batch.batch_id, "hold": 1})
        pipe.hincrby(counts, "left", 1)
    try:
        await pipe.execute()
    except Exception:
        # no record written: free the key, so that a retry makes the batch rather than
        # answering with one that does not exist (a record written answers it: cancel it)
        if batch.idempotency_key:
            key = _idempotency_key(store, batch.tenant, batch.idempotency_key)
            with contextlib.suppress(Exception):
                if not await store.redis.exists(record):
                    await store.redis.delete(key)
        raise
    head: list[Any] = [batch.batch_id, batch.tenant, batch.type, batch.queue, batch.priority]
    head += [batch.max_attempts, trace]
    # in rounds, one pipeline each: a call per shard with the round's children there, so no
    # call holds Redis long and the requests stay the size of plain batch submits'
    for start in range(0, len(batch.children), ROUND):
        calls: dict[int, list[Any]] = {}
        for child in batch.children[start : start + ROUND]:
            shard = keys.shard_of(child[0])
            args = calls.get(shard)
            if args is None:
                args = calls[shard] = [*head, 0]
            args.extend(child)
        for args in calls.values():
            args[len(head)] = (len(args) - len(head) - 1) // 2
        await store.scripts.call_many([("batch_submit", s, a) for s, a in calls.items()])
    await store.scripts.call_many([("batch_seal", shard, (batch.batch_id,)) for shard in by_shard])
    # the last write: with a durable submit, followed by WAIT (store/durable.py)
    await store.scripts.write(keys.shard_of(batch.batch_id), "HSET", record, "sealed", "1")
    return await read_batch(store, batch.batch_id, batch.tenant)


async def read_batch(store: Store, batch_id: str, tenant: str | None) -> BatchStatus:
    """The batch's status document; ``tenant`` None: any (admin). Another tenant's batch,
    or one no longer kept, is ``BatchNotFound``."""
    if not store.keys.valid_id(batch_id):
        raise BatchNotFound(batch_id)
    rec = cast(dict[bytes, bytes], await store.redis.hgetall(record_key(store, batch_id)))
    got = {k.decode(): v.decode() for k, v in rec.items()}
    if not got or (tenant is not None and got.get("tenant") != tenant):
        raise BatchNotFound(batch_id)
    shards = [int(s) for s in got.get("shards", "").split()]
    pipe = store.redis.pipeline(transaction=False)
    for shard in shards:
        pipe.hmget(_counts_key(store, shard, batch_id), "s", "f", "c")
    done = [0, 0, 0]
    for reply in await pipe.execute() if shards else []:
        for i, value in enumerate(reply):
            done[i] += int(value or 0)
    total = int(got["total"])
    # a retry reopens the batch in its children's scripts at once, and in the record only
    # when the resolver hands that on: the counts are the fresher
    finished = got.get("state") == "finished" and sum(done) == total
    return BatchStatus(
        id=batch_id,
        state="finished" if finished else "running",
        type=got.get("type", ""),
        queue=got.get("queue", ""),
        total=total,
        pending=total - sum(done),
        succeeded=done[0],
        failed=done[1],
        cancelled=done[2],
        cancel_requested=got.get("cancel") == "1",
        created_at_ms=int(got.get("created", 0)),
        finished_at_ms=int(got["fin"]) if finished and "fin" in got else None,
        callback_job=got["cbid"] if got.get("cbdone") == "1" else None,
    )


async def _each_child(
    store: Store,
    batch_id: str,
    script: str,
    args: Sequence[Any],
    where: Callable[[int, int], tuple[int, ...]] = lambda first, count: (),
) -> list[list[Any]]:
    """Run ``script`` (after ``args``, then ``where(position in its shard of the call's
    first id, the shard's children)``: how many ids, the ids) over every child of the batch,
    ``SCAN_CHUNK`` per call, every call in one pipeline; the replies."""
    total = await store.redis.hget(record_key(store, batch_id), "total")
    by_shard: dict[int, list[str]] = defaultdict(list)
    for job_id in child_ids(store.keys, batch_id, int(total or 0)):
        by_shard[store.keys.shard_of(job_id)].append(job_id)
    calls: list[Call] = [
        (script, shard, (batch_id, *args, *where(i, len(ids)), len(chunk), *chunk))
        for shard, ids in by_shard.items()
        for i, chunk in ((i, ids[i : i + SCAN_CHUNK]) for i in range(0, len(ids), SCAN_CHUNK))
    ]
    return await store.scripts.call_many(calls) if calls else []


def _position(first: int, count: int) -> tuple[int, int]:
    """A chunk's place among its shard's children: its first's position, and 1 if it ends
    with the shard's last (batch_cancel.lua counts the children not made from them)."""
    return first, int(first + SCAN_CHUNK >= count)


async def cancel_batch(store: Store, batch_id: str, tenant: str | None) -> tuple[int, int]:
    """Cancel the children not started, ask the running ones to stop; (cancelled, asked)."""
    await read_batch(store, batch_id, tenant)  # NotFound before anything changes
    await store.redis.hset(record_key(store, batch_id), "cancel", "1")
    ttl = store.settings.retention_seconds
    args = (tenant or "", ttl)
    replies = await _each_child(store, batch_id, "batch_cancel", args, _position)
    return sum(int(r[0]) for r in replies), sum(int(r[1]) for r in replies)


async def retry_batch(store: Store, batch_id: str, tenant: str | None) -> int:
    """Send the failed children back to their queue; how many."""
    await read_batch(store, batch_id, tenant)
    replies = await _each_child(store, batch_id, "batch_retry", (tenant or "",))
    return sum(int(r[0]) for r in replies)
