"""One member of a consumer group over one stream per shard: what the persister, the
webhook dispatcher and the flow resolver share. What to do with the entries is the role's.

It reads its own pending entries first (what it read before a restart under the same name,
or a failure, and never acknowledged), takes over those idle too long in members that died
(XAUTOCLAIM), acknowledges (``acks.py``) and, idle, waits in Redis: one blocking XREADGROUP
naming every stream, so the first entry of a burst is read as it is written and an idle
member sends one command per wait, not one per stream per nap. A Redis Cluster cannot (one
command names the streams of one node): there it naps. ``run`` is the roles' loop: it never
ends on a failure (nothing else would drain the streams), it backs off and retries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Protocol, cast

from redis.asyncio import RedisCluster

from jobtier.runtime.backoff import PERSIST_REDIS, BackoffPolicy
from jobtier.runtime.loop import FAULTS, wait_for
from jobtier.store.redis import RedisClient
from jobtier.streams.acks import Acks
from jobtier.streams.entries import transition_count
from jobtier.streams.group import create_groups, forget_idle_consumers, trim

Fields = dict[bytes, bytes] | None  # an entry's fields; None: pending, but trimmed meanwhile
Taken = tuple[int, bytes, Fields]  # (shard, entry id, fields)

NAP_MIN = 0.005
NAP_MAX = 0.1  # longest nap, and longest wait in Redis, when idle: idle CPU stays near zero
FORGET_EVERY = 60.0  # seconds between sweeps of the group's stopped members


class Counts(Protocol):
    claimed: int  # entries taken over from members that died


@dataclass(eq=False)
class Consumer:
    """Member ``name`` of ``group`` on ``streams`` (one per shard). ``claim_idle_ms``: how
    long an entry stays pending in a member before another takes it over. ``forget_idle_ms``:
    members holding nothing and idle that long are removed from the group when claiming
    (None: never). ``refused``, ``delete``: see ``Acks``. ``counts.claimed`` counts takeovers."""

    redis: RedisClient
    streams: list[str]
    group: str
    name: str
    _: KW_ONLY
    claim_idle_ms: int
    log: logging.Logger
    counts: Counts
    claimed_event: str = "entries_claimed"
    policy: BackoffPolicy = PERSIST_REDIS
    forget_idle_ms: int | None = None
    refused: Sequence[str] = ()
    delete: bool = False

    def __post_init__(self) -> None:
        self.acks = Acks(
            self.redis, self.streams, self.group, refused=self.refused, delete=self.delete
        )
        self.stopping = asyncio.Event()
        self.ready = False  # the group made (and whatever the role's setup adds)
        self.blocking = not isinstance(self.redis, RedisCluster)  # may wait in Redis when idle
        n = len(self.streams)
        self._cursor = [b"0"] * n  # b"0": own pending entries first; then b">", new ones
        self._claim_cursor = [b"0-0"] * n
        self._waited_in_vain = False  # the last wait in Redis found nothing
        self._next_claim = 0.0
        self._next_forget = 0.0
        self._per_entry = 1.0  # transitions an entry held, in the last read

    def entries_for(self, wanted: float) -> int:
        """Entries to ask a stream for to get about ``wanted`` transitions (an entry of a log
        holds one script call's: at as many an entry as the last read's held); at least 1."""
        return max(1, int(wanted / self._per_entry))

    def _note(self, out: list[Taken]) -> list[Taken]:
        """``out``, its entries' mean transitions noted for ``entries_for``."""
        held = [transition_count(fields) for _, _, fields in out if fields]
        if held:
            self._per_entry = sum(held) / len(held)
        return out

    def stop(self) -> None:
        self.stopping.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; True once ``stop()`` was called."""
        return await wait_for(self.stopping, seconds)

    async def setup(self) -> None:
        """Create the group on every stream (from its first entry) if missing."""
        await create_groups(self.redis, self.streams, self.group)
        self.ready = True

    def reread(self) -> None:
        """Read our own pending entries again from the start (after a failure)."""
        self._cursor = [b"0"] * len(self.streams)
        self._waited_in_vain = False

    async def read(
        self, count: int, shards: Iterable[int] | None = None
    ) -> tuple[list[int], list[Taken]]:
        """XREADGROUP up to ``count`` entries from each stream (or those of ``shards``) in one
        pipeline: (the shards that may have more, the entries). Nothing right after a wait
        in Redis that found nothing: it read every stream just now."""
        if self._waited_in_vain:
            self._waited_in_vain = False
            return [], []
        shards = range(len(self.streams)) if shards is None else list(shards)
        cursors = self._cursor
        pipe = self.redis.pipeline(transaction=False)
        for shard in shards:
            pipe.xreadgroup(
                self.group, self.name, {self.streams[shard]: cursors[shard]}, count=count
            )
        more: list[int] = []
        out: list[Taken] = []
        for shard, reply in zip(shards, await pipe.execute(), strict=True):
            items = reply[0][1] if reply else []
            if cursors[shard] != b">":
                # own pending entries from a previous life, then new ones
                cursors[shard] = items[-1][0] if items else b">"
                more.append(shard)
            elif len(items) == count:
                more.append(shard)
            out += [(shard, entry_id, fields) for entry_id, fields in items]
        return more, self._note(out)

    async def wait(self, count: int) -> list[Taken] | None:
        """Idle: one XREADGROUP naming every stream, blocked in Redis up to ``NAP_MAX`` until
        one has new entries (``count`` at most each); empty when none came. None, at once,
        when it cannot wait so (a Redis Cluster; our own pending entries still being read
        back; stopping): the caller naps instead."""
        if not self.blocking or self.stopping.is_set() or any(c != b">" for c in self._cursor):
            return None
        began = time.monotonic()
        reply = await self.redis.xreadgroup(
            self.group,
            self.name,
            dict.fromkeys(self.streams, ">"),
            count=count,
            block=int(NAP_MAX * 1000),
        )
        shard_of = {stream: shard for shard, stream in enumerate(self.streams)}
        out: list[Taken] = []
        # [[stream, entries], …] (RESP2, as our clients speak); a stream's name comes back as
        # bytes, or as str from a client that decodes replies
        for stream, items in cast(
            list[tuple[bytes | str, list[tuple[bytes, Fields]]]], reply or []
        ):
            shard = shard_of[stream.decode() if isinstance(stream, bytes) else stream]
            out += [(shard, entry_id, fields) for entry_id, fields in items]
        waited = time.monotonic() - began
        if not out and waited < NAP_MAX / 2:
            # answered empty at once (something between us and Redis that does not block):
            # nap the rest rather than spin
            await self.sleep(NAP_MAX - waited)
        self._waited_in_vain = not out
        return self._note(out)

    async def claim(
        self, count: int, keep: Callable[[int, bytes, Fields], bool] | None = None
    ) -> list[Taken]:
        """XAUTOCLAIM every stream in one pipeline: the entries pending longer than the claim
        idle time in another member (it died) become ours, up to ``count`` a stream; those
        ``keep`` accepts (all without it) are counted, logged and returned. Each stream's scan
        goes on where it stopped at the next call; then, when due, the stopped members are
        forgotten."""
        pipe = self.redis.pipeline(transaction=False)
        for stream, start in zip(self.streams, self._claim_cursor, strict=True):
            pipe.xautoclaim(stream, self.group, self.name, self.claim_idle_ms, start, count=count)
        out: list[Taken] = []
        for shard, (start, items, *_) in enumerate(await pipe.execute()):
            self._claim_cursor[shard] = start
            taken = [(shard, entry_id, fields) for entry_id, fields in items]
            if keep is not None:
                taken = [t for t in taken if keep(*t)]
            if taken:
                self.counts.claimed += len(taken)
                self.log.info(
                    "event=%s stream=%s count=%d",
                    self.claimed_event,
                    self.streams[shard],
                    len(taken),
                )
            out += taken
        if self.forget_idle_ms is not None and time.monotonic() >= self._next_forget:
            self._next_forget = time.monotonic() + FORGET_EVERY
            await self.forget()
        return out

    async def claim_due(
        self, count: int, keep: Callable[[int, bytes, Fields], bool] | None = None
    ) -> list[Taken]:
        """``claim`` every half claim idle time (at most every 50 ms); else nothing."""
        now = time.monotonic()
        if now < self._next_claim:
            return []
        self._next_claim = now + max(0.05, self.claim_idle_ms / 2000)
        return await self.claim(count, keep)

    def claim_soon(self) -> None:
        """The next ``claim_due`` claims at once (a scan that stopped part-way goes on)."""
        self._next_claim = 0.0

    @property
    def swept(self) -> bool:
        """Did the last ``claim`` scan every stream's pending entries to the end?"""
        return all(c == b"0-0" for c in self._claim_cursor)

    async def forget(self) -> int:
        """Remove the members that hold nothing and were idle ``forget_idle_ms`` (stopped:
        a restart under a new name leaves the old one behind). One with pending entries is
        kept: ``claim`` takes those over first."""
        removed = await forget_idle_consumers(
            self.redis, self.streams, self.group, self.name, self.forget_idle_ms or 0
        )
        if removed:
            self.log.info("event=dead_consumers_removed count=%d", removed)
        return removed

    async def trim(self) -> None:
        """Drop the entries every group on the streams has acknowledged (``group.trim``)."""
        await trim(self.redis, self.streams)

    async def ack(self, entries: Iterable[tuple[int, bytes]]) -> None:
        """Acknowledge (shard, entry id)s now, with whatever else is owed."""
        self.acks.add_many(entries)
        await self.acks.flush()

    def bad_entry(self, shard: int, entry_id: bytes, exc: BaseException) -> None:
        self.log.error(
            "event=bad_log_entry stream=%s id=%s error=%r",
            self.streams[shard],
            entry_id.decode(),
            exc,
        )

    async def run(
        self,
        step: Callable[[], Awaitable[object]],
        failed: Callable[[Exception, float], bool],
        *,
        setup: Callable[[], Awaitable[None]] | None = None,
        idle: Callable[[], Awaitable[object]] | None = None,
        reread_after_bug: bool = True,
    ) -> None:
        """Until ``stop()``: ``setup`` (``self.setup`` by default; it sets ``ready``) while not
        ready, then ``step`` (True when it did something). A failure is handed to ``failed``
        with the back-off's wait, to be logged (True: the group may be gone, a restarted or
        flushed Redis: set up again); our pending entries are read again (after a failure of
        Redis, or any with ``reread_after_bug``) and the wait slept. Idle, ``idle()`` is
        awaited, or a nap from ``NAP_MIN`` doubling to ``NAP_MAX``."""
        backoff, nap = self.policy.start(), NAP_MIN
        while not self.stopping.is_set():
            try:
                if not self.ready:
                    await (setup or self.setup)()
                moved = await step()
                backoff.reset()
            except Exception as exc:
                wait = backoff.next()
                gone = failed(exc, wait)
                if gone:
                    self.ready = False
                # a lost XREADGROUP reply leaves entries pending to us that we never saw
                if gone or reread_after_bug or isinstance(exc, FAULTS):
                    self.reread()
                await self.sleep(wait)
                continue
            if moved:
                nap = NAP_MIN
            elif idle is not None:
                await idle()
            else:
                await self.sleep(nap)
                nap = min(nap * 2, NAP_MAX)
