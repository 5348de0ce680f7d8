"""Which tenants may have webhook targets: one Redis hash (``Keys.webhook_tenants``).

Most transitions have no target: the dispatcher acknowledges an entry whose tenant (its
``tn`` field) is not marked without decoding it or asking Postgres.

A tenant is marked BEFORE its first target is written, and again once it is written (before
the API answers, before the job's submit): the API around a subscription's row,
``CallbackStore.register`` around callback rows, and the dispatcher's start-up for every
tenant Postgres already has targets for. Each write holds a new value (its time and a
random part). The dispatchers remove the marks of tenants left without a target
(``unmark_idle``), which the second mark makes safe: upgrade the API (and in-process
producers) before the dispatchers, since an older one does not write it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence

from jobtier.core.keys import Keys
from jobtier.store.redis import RedisClient
from jobtier.store.scripts import Script, run_script
from jobtier.webhooks.deliveries import DeliveryStore

CHUNK = 1000  # tenants per HSET, per HSCAN page and per Postgres question
_UNMARK = Script("unmark")


def new_value() -> str:
    """A mark's value: when it was written (ms since the epoch) and a random part, so that no
    two writes hold the same value."""
    return f"{time.time_ns() // 1_000_000}.{os.urandom(6).hex()}"


def written_at(value: bytes) -> float:
    """When a mark was written (s since the epoch); 0 for an older mark without a time."""
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

    Call it only after the reply of the XREADGROUP/XAUTOCLAIM that returned the entries: a
    mark is acknowledged before the job's submit is sent, so this read, sent after the entry
    was read, sees it. That is ordering in real time, so it holds on a Cluster too, where the
    hash and the logs live on different nodes; sent in the same pipeline as the XREADGROUP,
    the read could reach the hash's node before the entry's XADD reached the log's.
    """
    if not tenants:
        return set()
    found = await redis.hmget(keys.webhook_tenants(), list(tenants))
    return {t for t, v in zip(tenants, found, strict=True) if v is not None}


async def unmark_idle(redis: RedisClient, keys: Keys, store: DeliveryStore, min_age: float) -> int:
    """Remove the marks, written at least ``min_age`` seconds ago, of tenants with no live
    subscription and no job's callback in Postgres; returns how many were removed.

    The race: a target created while its tenant is being unmarked. The writer marks, inserts
    its row, then marks again; this reads each mark's value, then asks Postgres, then deletes
    a mark only if it still holds the value read (unmark.lua, atomically). The writer's second
    mark comes after its commit: written after the removal, it restores the mark before the
    API answers; written after the read, it changed the value (no removal); written before the
    read, Postgres sees the row (no removal). ``min_age`` also spares the first mark while
    the row is being written.
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
