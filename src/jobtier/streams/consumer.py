"""Reading the shard log streams as a consumer group, and the groups' housekeeping.

Reading (``read_group``, ``claim_idle``) serves both groups that consume the logs: the
persisters and the webhook dispatchers. Housekeeping: trimming what every group has
acknowledged, forgetting the members that stopped, and sending the entries Postgres refused
back to the logs. The persister runs the first two from its loop; ``jobtier persister
--replay-refused`` runs the third.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from redis.asyncio import RedisCluster
from redis.exceptions import ResponseError

from jobtier.core.keys import Keys
from jobtier.store.redis import RedisClient
from jobtier.store.scripts import Script, run_scripts

log = logging.getLogger("jobtier.persist")

_FORGET = Script("forget_consumers")

Fields = dict[bytes, bytes] | None  # an entry's fields; None: pending, but trimmed meanwhile


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


async def read_group(
    redis: RedisClient,
    group: str,
    name: str,
    streams: Sequence[str],
    cursors: list[bytes],
    count: int,
) -> tuple[bool, list[tuple[int, bytes, Fields]]]:
    """XREADGROUP every stream in one pipeline, up to ``count`` entries each, as member
    ``name``: (True if some stream may have more, [(shard, entry id, fields)]).

    ``cursors`` (one per stream, moved on here) start at ``b"0"``: the member's own pending
    entries, from a previous life, are read again first; once a stream has none left, its
    cursor is ``b">"``, new entries.
    """
    pipe = redis.pipeline(transaction=False)
    for stream, cursor in zip(streams, cursors, strict=True):
        pipe.xreadgroup(group, name, {stream: cursor}, count=count)
    more = False
    out: list[tuple[int, bytes, Fields]] = []
    for shard, reply in enumerate(await pipe.execute()):
        items = reply[0][1] if reply else []
        if cursors[shard] != b">":
            # own pending entries from a previous life, then new ones
            cursors[shard] = items[-1][0] if items else b">"
            more = True
        elif len(items) == count:
            more = True
        out += [(shard, entry_id, fields) for entry_id, fields in items]
    return more, out


async def wait_idle(
    redis: RedisClient,
    group: str,
    name: str,
    streams: Sequence[str],
    cursors: Sequence[bytes],
    count: int,
    block: float,
    nap: Callable[[float], Awaitable[object]],
) -> list[tuple[int, bytes, Fields]] | None:
    """For a member with nothing to do: one XREADGROUP naming every stream, blocked in Redis
    for up to ``block`` seconds until one of them has new entries, ``count`` at most each:
    [(shard, entry id, fields)], empty when none came.

    It sees the first entry of a burst as it is written, and an idle member sends one
    command per ``block`` instead of one per stream per nap. None, at once, when it cannot
    wait so, and the caller naps instead: on a Redis Cluster (one command names streams of
    one node only), or while the member's own pending entries are still being read back
    (``cursors`` not all at ``>``). Should Redis answer empty at once (something between us
    and it that does not block), ``nap`` the rest rather than spin.
    """
    if isinstance(redis, RedisCluster) or any(c != b">" for c in cursors):
        return None
    began = time.monotonic()
    reply = await redis.xreadgroup(
        group, name, dict.fromkeys(streams, ">"), count=count, block=max(1, int(block * 1000))
    )
    shard_of = {stream: shard for shard, stream in enumerate(streams)}
    out: list[tuple[int, bytes, Fields]] = []
    # [[stream, entries], …] (RESP2, as our clients speak); a stream's name comes back as
    # bytes, or as str from a client that decodes replies
    for stream, items in cast(list[tuple[bytes | str, list[tuple[bytes, Fields]]]], reply or []):
        shard = shard_of[stream.decode() if isinstance(stream, bytes) else stream]
        out += [(shard, entry_id, fields) for entry_id, fields in items]
    waited = time.monotonic() - began
    if not out and waited < block / 2:
        await nap(block - waited)
    return out


async def claim_idle(
    redis: RedisClient,
    group: str,
    name: str,
    streams: Sequence[str],
    starts: list[bytes],
    idle_ms: int,
    count: int,
) -> list[list[tuple[bytes, Fields]]]:
    """XAUTOCLAIM every stream in one pipeline: the entries pending longer than ``idle_ms``
    in another member of ``group`` (it died) become ``name``'s. Per stream, the (entry id,
    fields) taken over; ``starts`` (one per stream, moved on here) is where each scan goes on
    at the next call."""
    pipe = redis.pipeline(transaction=False)
    for stream, start in zip(streams, starts, strict=True):
        pipe.xautoclaim(stream, group, name, idle_ms, start, count=count)
    out = []
    for shard, reply in enumerate(await pipe.execute()):
        starts[shard] = reply[0]
        out.append(reply[1])
    return out


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
    removed = sum(len(names) for names in await run_scripts(redis, calls))
    if removed:
        log.info("event=dead_consumers_removed count=%d", removed)
    return removed


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
