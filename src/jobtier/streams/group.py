"""A consumer group's housekeeping on its streams: creating it, trimming what every group
has acknowledged, forgetting the members that stopped, and sending the entries Postgres
refused back to the logs. The persister runs the middle two from its loop (through its
``Consumer``); ``jobtier persister --replay-refused`` runs the last. And ``group_lag``: how far
behind a group is (``lag``: the persisters').
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from jobtier.core.keys import Keys
from jobtier.store.redis import RedisClient
from jobtier.store.scripts import Script, run_scripts

log = logging.getLogger("jobtier.persist")

_FORGET = Script("forget_consumers")
_LAG = Script("log_lag")
_SHARED = Script("lag_shared")
# undelivered entries per shard counted one by one (log_lag.lua), each read whole: an entry
# holds the transitions of one script call, up to 100 of them
LAG_EXACT_UP_TO = 4
# pending entries per shard read (log_lag.lua): all when no more; else the oldest, the newest
# and the rest at the mean of those between them read
LAG_PENDING_READ = 4
# how long one process's count of the persisters' lag serves the others (shared_lag)
LAG_SHARED_MS = 1000


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


def _id_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


@dataclass(frozen=True, slots=True)
class GroupLag:
    """How far behind a consumer group is: the ``transitions`` of the entries it has not yet
    acknowledged, the age in ``seconds`` of the oldest one, and whether the group is on any
    shard's log at all (``exists``; where it is not, every entry counts as waiting for it)."""

    transitions: int
    seconds: float
    exists: bool


async def lag(
    redis: RedisClient, keys: Keys, exact: int = LAG_EXACT_UP_TO, pending: int = LAG_PENDING_READ
) -> tuple[int, float]:
    """(transitions not yet acknowledged by the persisters, age in seconds of the oldest
    one): ``group_lag`` of their group."""
    found = await group_lag(redis, keys, keys.persist_group(), exact, pending)
    return found.transitions, found.seconds


async def group_lag(
    redis: RedisClient,
    keys: Keys,
    group: str,
    exact: int = LAG_EXACT_UP_TO,
    pending: int = LAG_PENDING_READ,
) -> GroupLag:
    """How far ``group`` is behind on the transition logs.

    Per shard, one read-only script call (``store/lua/log_lag.lua``, all in one pipeline): the
    group's pending entries plus those after its last-delivered id, counted in the stream (a
    restart from the AOF can leave Redis's own ``lag`` counter stale). Up to ``exact``
    undelivered entries per shard are counted one by one, each read whole; beyond that it is
    Redis's ``lag`` bounded by the entries present, so a call costs the same however long
    the backlog. An entry holds the transitions of one script call: those read are counted
    exactly, the others undelivered at their mean; of the pending ones, up to
    ``LAG_PENDING_READ`` are read (the oldest and the newest, and others at even steps of
    their ids between), the rest counted at the mean of those between. The age and a count
    of 0 stay exact whatever the bound; a caller that wants only those calls
    ``oldest_waiting``, which reads next to nothing. Callers on hot paths share it
    (``shared_lag``: the API processes, one count a second between them).
    """
    return await _lag(redis, keys, group, max(1, exact), max(2, pending))


def lag_key(keys: Keys) -> str:
    """string "<transitions> <oldest id's ms>": the persisters' lag as one process counted it,
    read by the others until it expires (``shared_lag``)."""
    return f"{keys.prefix}:persist-lag"


async def shared_lag(redis: RedisClient, keys: Keys) -> tuple[int, float, float]:
    """(``lag``: transitions waiting for the persisters, the age of the oldest in seconds;
    the seconds this count stays current), counted by one process of a deployment and read
    by the others until ``LAG_SHARED_MS`` after it was made (``lag_key``, which
    expires then). A count reads up to a dozen whole entries a shard, of up to 100
    transitions each: with entries of 50, about 13 ms of Redis a call on a slow host
    (2026-12-06, a throwaway script), which every API process paid once a second; shared,
    a deployment pays it about once a second whatever its API processes. The age is taken
    from the oldest entry's id at each read, so it is current whoever counted."""
    key = lag_key(keys)
    ((raw, ttl),) = await run_scripts(redis, [(_SHARED, (1, key))])
    # a count whose expiry is further than it was set for is not trusted: SET's PX is
    # replicated as an absolute time, so a replica whose clock is behind, promoted, or a
    # clock stepped back, would keep it for longer (and every process would keep it too)
    if raw and 0 < ttl <= LAG_SHARED_MS:
        try:
            transitions, oldest = (int(v) for v in raw.split())
        except ValueError:
            pass  # written by another version: counted again, and written over
        else:
            return transitions, _age(oldest or None), ttl / 1000
    found = await _count(redis, keys, keys.persist_group(), LAG_EXACT_UP_TO, LAG_PENDING_READ)
    total, oldest_ms, _ = found
    try:
        await redis.set(key, f"{total} {oldest_ms or 0}", px=LAG_SHARED_MS)
    except ResponseError:  # full (noeviction), or a replica: the count is ours alone then
        pass
    return total, _age(oldest_ms), LAG_SHARED_MS / 1000


async def oldest_waiting(
    redis: RedisClient, keys: Keys, group: str | None = None
) -> tuple[bool, float]:
    """(whether any transition waits for ``group``, the persisters' by default; the age in
    seconds of the oldest one): for callers that want no count (a sampler). A shard's call
    reads no entry where the group has one pending, else at most the first undelivered one;
    ``group_lag`` reads up to a dozen whole entries a shard, of up to 100 transitions each,
    which is what its calls cost Redis. Unlike its count, an entry trimmed from its stream
    while pending (nothing left to write) waits here until a member acknowledges it: a wait
    for the write-behind to catch up asks ``lag`` whether anything waits."""
    found = await _lag(redis, keys, group or keys.persist_group(), 1, 0)
    return found.transitions > 0, found.seconds


async def _lag(redis: RedisClient, keys: Keys, group: str, exact: int, pending: int) -> GroupLag:
    total, oldest_ms, exists = await _count(redis, keys, group, exact, pending)
    return GroupLag(total, _age(oldest_ms), exists)


async def _count(
    redis: RedisClient, keys: Keys, group: str, exact: int, pending: int
) -> tuple[int, int | None, bool]:
    """log_lag.lua on every shard: (transitions waiting, the oldest one's id's milliseconds
    or None, whether the group is on a shard's log)."""
    calls = [(_LAG, (1, keys.log(s), group, exact, pending)) for s in range(keys.shards)]
    total, oldest_ms, exists = 0, None, False
    for count, oldest, *found in await run_scripts(redis, calls):
        total += int(count)
        exists = exists or bool(found and int(found[0]))
        if oldest:
            ms = _id_ms(oldest)
            oldest_ms = ms if oldest_ms is None else min(oldest_ms, ms)
    return total, oldest_ms, exists


def _age(oldest_ms: int | None) -> float:
    """Seconds since the Redis-clock milliseconds of an entry's id, by our clock."""
    return 0.0 if oldest_ms is None else max(0.0, time.time() - oldest_ms / 1000)
