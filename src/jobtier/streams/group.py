"""A consumer group's housekeeping on its streams: creating it, trimming what every group
has acknowledged, forgetting the members that stopped, and sending the entries Postgres
refused back to the logs. The persister runs the middle two from its loop (through its
``Consumer``); ``jobtier persister --replay-refused`` runs the last.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from jobtier.core.keys import Keys
from jobtier.store.redis import RedisClient
from jobtier.store.scripts import Script, run_scripts

log = logging.getLogger("jobtier.persist")

_FORGET = Script("forget_consumers")


async def create_groups(
    redis: RedisClient, streams: Sequence[str], group: str, start: str = "0"
) -> None:
    """Create consumer group ``group`` on every stream (made if missing) from ``start``;
    a group that exists already is left as it is (BUSYGROUP)."""
    pipe = redis.pipeline(transaction=False)
    for stream in streams:
        pipe.xgroup_create(stream, group, id=start, mkstream=True)
    for reply in await pipe.execute(raise_on_error=False):
        if isinstance(reply, ResponseError) and "BUSYGROUP" in str(reply):
            continue
        if isinstance(reply, Exception):
            raise reply


def _next_id(entry_id: bytes) -> bytes:
    ms, _, seq = entry_id.partition(b"-")
    return b"%s-%d" % (ms, int(seq or b"0") + 1)


def _key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or b"0")


async def trim(redis: RedisClient, streams: Sequence[str]) -> None:
    """Drop log entries every consumer group has acknowledged.

    Per shard and group, everything below the lowest pending id has been delivered (groups
    deliver in id order) and is no longer pending, so it was acknowledged; with nothing
    pending, everything up to the last delivered id was. XINFO GROUPS runs before XPENDING
    on the same connection: an entry delivered between the two has an id above the
    last-delivered id we read, so it cannot be trimmed while still pending.
    """
    pipe = redis.pipeline(transaction=False)
    for stream in streams:
        pipe.xinfo_groups(stream)
    infos = await pipe.execute(raise_on_error=False)
    pipe = redis.pipeline(transaction=False)
    asked: list[tuple[int, bytes]] = []
    for shard, groups in enumerate(infos):
        if isinstance(groups, Exception) or not groups:
            continue
        for g in groups:
            pipe.xpending(streams[shard], g["name"])
            asked.append((shard, g["last-delivered-id"]))
    floors: dict[int, bytes] = {}
    for (shard, delivered), pending in zip(asked, await pipe.execute(), strict=True):
        floor = pending["min"] if pending["pending"] else _next_id(delivered)
        if shard not in floors or _key(floor) < _key(floors[shard]):
            floors[shard] = floor
    pipe = redis.pipeline(transaction=False)
    for shard, floor in floors.items():
        pipe.xtrim(streams[shard], minid=floor, approximate=False)
    if floors:
        await pipe.execute()


async def forget_idle_consumers(
    redis: RedisClient, streams: Sequence[str], group: str, keep: str, idle_ms: int
) -> int:
    """Remove the group's consumers that hold no pending entry and were idle ``idle_ms``
    (``keep``, the caller, excepted); returns how many. Checked and removed atomically per
    stream (``store/lua/forget_consumers.lua`` says why that matters)."""
    calls = [(_FORGET, (1, stream, group, idle_ms, keep)) for stream in streams]
    return sum(len(names) for names in await run_scripts(redis, calls))


async def replay_refused(redis: RedisClient, keys: Keys) -> int:
    """Send every parked entry (``log:refused``) back to its shard's log, for the persisters
    to try again once the cause is fixed (a migration, a constraint). Each entry is added to
    the log before it is deleted from the parked stream: interrupted, an entry is at worst
    sent twice, which the persisters' writes make harmless. Returns the entries moved."""
    moved = 0
    for shard in range(keys.shards):
        source, target = keys.log_refused(shard), keys.log(shard)
        newest: Any = await redis.xrevrange(source, count=1)
        if not newest:
            continue
        last = newest[0][0]  # entries refused again meanwhile come after it: not this run's
        while True:
            entries: Any = await redis.xrange(source, max=last, count=500)  # [(id, fields)]
            if not entries:
                break
            pipe = redis.pipeline(transaction=False)
            for entry_id, fields in entries:
                kept: dict[Any, Any] = {
                    k: v for k, v in fields.items() if not k.startswith(b"refused_")
                }
                pipe.xadd(target, kept)
                pipe.xdel(source, entry_id)
            await pipe.execute()
            moved += len(entries)
    if moved:
        log.info("event=refused_entries_replayed count=%d", moved)
    return moved
