"""Which tenants may have webhook targets: one Redis hash (``Keys.webhook_tenants``).

Most transitions have no target. Without this, the dispatcher decoded every log entry and
asked Postgres for the targets of every batch; with it, an entry whose tenant (its ``tn``
field) is not marked is acknowledged undecoded, and Postgres is not asked.

A tenant is marked BEFORE its first target is written: the API marks it before a
subscription's row, ``CallbackStore.register`` before callback rows (so before the job's
submit), and the dispatcher's start-up marks every tenant Postgres already has targets for
(a deployment upgraded with webhooks in place keeps them). Markers are never removed: a
deleted subscription leaves its tenant marked, which only costs that tenant the old path
(decode and look up). Upgrade the API before the dispatchers: an older API writes targets
without marking.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jobtier.connection import RedisClient
from jobtier.keys import Keys

CHUNK = 1000  # tenants per HSET at start-up


async def mark(redis: RedisClient, keys: Keys, tenants: Iterable[str]) -> None:
    """Mark ``tenants`` as possibly having webhook targets (idempotent)."""
    names = sorted(set(tenants))
    for start in range(0, len(names), CHUNK):
        await redis.hset(
            keys.webhook_tenants(), mapping=dict.fromkeys(names[start : start + CHUNK], "1")
        )


async def marked(redis: RedisClient, keys: Keys, tenants: Sequence[bytes]) -> set[bytes]:
    """The ``tenants`` (as the log's ``tn`` fields hold them) that are marked.

    Call it only after the reply of the XREADGROUP/XAUTOCLAIM that returned the entries.
    A mark is written, and acknowledged, before its target's row, and that before the job's
    submit is sent; so every entry of a marked tenant's job was appended to its log after
    the mark, and this read, sent once the entry has been read, comes later still and sees
    the mark. That is ordering in real time, not within one server, so it holds on a Redis
    Cluster too, where the hash and the logs live on different nodes (each node answers
    commands in the order they arrive; nothing here reads a replica). Sent in the same
    pipeline as the XREADGROUP, the read could reach the hash's node before the entry's
    XADD reached the log's, and miss a mark written just before that submit.
    """
    if not tenants:
        return set()
    found = await redis.hmget(keys.webhook_tenants(), list(tenants))
    return {t for t, v in zip(tenants, found, strict=True) if v is not None}
