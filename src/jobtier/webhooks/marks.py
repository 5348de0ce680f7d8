"""Which tenants may have webhook targets: one Redis hash (``Keys.webhook_tenants``).

Most transitions have no target. Without this, the dispatcher decoded every log entry and
asked Postgres for the targets of every batch; with it, an entry whose tenant (its ``tn``
field) is not marked is acknowledged undecoded, and Postgres is not asked.

A tenant is marked BEFORE its first target is written, and again once it is written (before
the API answers, before the job's submit): the API marks it around a subscription's row,
``CallbackStore.register`` around callback rows, and the dispatcher's start-up marks every
tenant Postgres already has targets for (a deployment upgraded with webhooks in place keeps
them). Each write of a mark holds a new value (the time it was written and a random part).

The dispatchers remove the marks of tenants left without a target (``unmark_idle``): a
tenant that deleted its last subscription, whose jobs' callbacks retention deleted with the
jobs, no longer costs a decode and a look-up per transition. Upgrade the API (and in-process
producers) before the dispatchers: an older one writes targets without the second mark,
which is what makes the removal safe (``unmark_idle`` says why).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence

from jobtier.core.keys import Keys
from jobtier.store.redis import RedisClient
from jobtier.store.scripts import Script, run_script
from jobtier.webhooks.deliveries import DeliveryStore

CHUNK = 1000  # tenants per HSET at start-up, per HSCAN page and Postgres question when unmarking
_UNMARK = Script("unmark")


def new_value() -> str:
    """A mark's value: when it was written (ms since the epoch) and a random part, so that no
    two writes hold the same value."""
    return f"{time.time_ns() // 1_000_000}.{os.urandom(6).hex()}"


def written_at(value: bytes) -> float:
    """When a mark was written (s since the epoch); 0 for one written without a time (the
    "1" of marks older than the clean-up)."""
    stamp, dot, _ = value.partition(b".")
    try:
        return int(stamp) / 1000 if dot else 0.0
    except ValueError:
        return 0.0


async def mark(redis: RedisClient, keys: Keys, tenants: Iterable[str]) -> None:
    """Mark ``tenants`` as possibly having webhook targets (idempotent)."""
    names = sorted(set(tenants))
    value = new_value()
    for start in range(0, len(names), CHUNK):
        await redis.hset(
            keys.webhook_tenants(), mapping=dict.fromkeys(names[start : start + CHUNK], value)
        )


async def marked(redis: RedisClient, keys: Keys, tenants: Sequence[bytes]) -> set[bytes]:
    """The ``tenants`` (as the log's ``tn`` fields hold them) that are marked.

    Call it only after the reply of the XREADGROUP/XAUTOCLAIM that returned the entries.
    A mark is written, and acknowledged, once its target's row is committed and before the
    job's submit is sent, and stays while the target exists (``unmark_idle``); so every
    entry of a marked tenant's job was appended to its log after the mark, and this read,
    sent once the entry has been read, comes later still and sees the mark. That is ordering in real time, not within one server, so it holds on a Redis
    Cluster too, where the hash and the logs live on different nodes (each node answers
    commands in the order they arrive; nothing here reads a replica). Sent in the same
    pipeline as the XREADGROUP, the read could reach the hash's node before the entry's
    XADD reached the log's, and miss a mark written just before that submit.
    """
    if not tenants:
        return set()
    found = await redis.hmget(keys.webhook_tenants(), list(tenants))
    return {t for t, v in zip(tenants, found, strict=True) if v is not None}


async def unmark_idle(redis: RedisClient, keys: Keys, store: DeliveryStore, min_age: float) -> int:
    """Remove the marks, written at least ``min_age`` seconds ago, of tenants that have no
    live subscription and no job's callback in Postgres; returns how many were removed.

    The race this guards against: a target created while its tenant is being unmarked. The
    writer marks, inserts its row, then marks again; this reads each mark's value, then asks
    Postgres, then deletes a mark only if it still holds the value read (``store/lua/unmark.lua``,
    atomically). Postgres can answer "no target" for a row committed a moment later, and the
    mark removed then may be the writer's first; but the writer's second mark comes after its
    commit, so either it is written after the removal (the mark is back before the API
    answers or the job is submitted), or it is written before it: then it changed the value
    if it came after the read (the removal skips the tenant), or, if it came before, the read
    came after the commit and Postgres sees the row (no removal). So from the writer's
    second mark on, the tenant stays marked while its target exists, which is what
    ``marked`` relies on. ``min_age`` (a mark written lately is kept) also spares the first
    mark while the row is being written, when a transition of another of the tenant's jobs
    could be skipped before the subscription's creation has been answered.
    """
    hash_key = keys.webhook_tenants()
    now = time.time()
    removed = 0
    cursor = 0
    while True:
        page: dict[bytes, bytes]
        cursor, page = await redis.hscan(hash_key, cursor, count=CHUNK)  # type: ignore[assignment]
        # values read BEFORE Postgres is asked: the compare-and-delete relies on that order
        old = {t: v for t, v in page.items() if now - written_at(v) >= min_age}
        if old:
            keep = await store.with_targets([t.decode() for t in old])
            argv = [x for t, v in old.items() if t.decode() not in keep for x in (t, v)]
            if argv:
                removed += int(await run_script(redis, _UNMARK, (1, hash_key, *argv)))
        if cursor == 0:
            return removed
