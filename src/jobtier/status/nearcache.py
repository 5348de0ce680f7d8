"""The near cache: a small bounded map of status documents inside each API process."""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import islice

import msgspec


class Entry(msgspec.Struct, frozen=True, gc=False):
    """One cached status. ``gc=False``: it holds only str/int/bytes/float, so it can never be
    part of a reference cycle, and 100K of them stay out of the cyclic collector's scans,
    whose pauses make the read path's latency tail."""

    tenant: str
    version: int
    doc: bytes
    stored_at: float  # clock reading when the entry was loaded or last advanced by an event
    # a terminal document stored while every event subscription was live: it is kept for
    # final_ttl rather than ttl (see NearCache)
    final: bool = False


class NearCache:
    """Job id -> :class:`Entry`, bounded, kept fresh by the shard event channels.

    Freshness comes from events: ``on_event`` advances entries that are present (it never
    adds one, or every job in the system would end up here). The TTL is only a safety net
    for events that were missed without the subscription noticing; ``clear()`` is for when
    it did notice (a lost subscription, a resubscription).

    A *final* entry (``Entry.final``: a terminal document — succeeded, failed, cancelled —
    stored while the subscriptions were live) is kept for ``final_ttl`` instead, bounded by
    ``maxsize`` like any other: a terminal job changes only through a replay, which publishes
    its event, and a subscription found lost empties the cache before its events could be
    missed for long (store/redis.py: ShardSubscriber pings, reader.py: on_lost).

    Races it guards:

    * a slow load racing a fresher event: ``put`` never replaces a newer version with an
      older one, so a load answered before a transition but delivered after its event
      cannot roll the entry back;
    * loads that straddle a ``clear()``: ``generation`` increases on every clear, and a
      loader that read it before sending can skip its ``put`` (its data may predate events
      that were missed while the subscription was down).

    Eviction is FIFO by first insertion; a hit does not reorder (a dict lookup is the whole
    cost of a hit). When full, the oldest 1/64 of the entries go at once: a dict popping its
    oldest key one at a time rescans the deleted slots at its front on every pop, while a
    batch pays that scan once per many inserts.
    An evicted hot job costs one reload. Expired entries are dropped when read.
    """

    __slots__ = (
        "_clock",
        "_data",
        "_evict_batch",
        "events_applied",
        "evictions",
        "expired",
        "final_ttl",
        "generation",
        "hits",
        "maxsize",
        "misses",
        "ttl",
    )

    def __init__(
        self,
        maxsize: int = 100_000,
        ttl: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        final_ttl: float | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self.ttl = ttl
        self.final_ttl = ttl if final_ttl is None else max(ttl, final_ttl)
        self._clock = clock
        self._data: dict[str, Entry] = {}
        self._evict_batch = max(1, maxsize // 64)
        self.generation = 0  # bumped by clear()
        self.hits = 0
        self.misses = 0  # every get() that returned None, expired ones included
        self.expired = 0
        self.evictions = 0
        self.events_applied = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._data

    def get(self, job_id: str, now: float) -> Entry | None:
        """The entry, or None when absent or older than the TTL (``now`` from the clock)."""
        entry = self._data.get(job_id)
        if entry is None:
            self.misses += 1
            return None
        if now - entry.stored_at > (self.final_ttl if entry.final else self.ttl):
            del self._data[job_id]
            self.expired += 1
            self.misses += 1
            return None
        self.hits += 1
        return entry

    def put(self, job_id: str, entry: Entry) -> bool:
        """Store ``entry`` unless a newer version is already held; True when stored."""
        data = self._data
        old = data.get(job_id)
        if old is None:
            if len(data) >= self.maxsize:
                self._evict()
        elif old.version > entry.version and entry.stored_at - old.stored_at <= (
            self.final_ttl if old.final else self.ttl
        ):
            # no regression (slow load vs fresher event); an expired entry is not trusted,
            # so whatever was loaded after it expired replaces it
            return False
        data[job_id] = entry
        return True

    def on_event(
        self, job_id: str, version: int, tenant: str, doc: bytes, final: bool = False
    ) -> bool:
        """Apply a published change to a present entry; True when its version advanced.

        Absent ids are ignored: the cache holds what is being read, not every job.
        """
        old = self._data.get(job_id)
        if old is None or version <= old.version:
            return False
        self._data[job_id] = Entry(tenant, version, doc, self._clock(), final)
        self.events_applied += 1
        return True

    def clear(self) -> None:
        """Forget everything (events may have been missed); loads in flight see the new
        ``generation`` and do not store what they read before."""
        self._data.clear()
        self.generation += 1

    def discard(self, job_id: str) -> None:
        self._data.pop(job_id, None)

    def _evict(self) -> None:
        data = self._data
        oldest = list(islice(data, self._evict_batch))
        for job_id in oldest:
            del data[job_id]
        self.evictions += len(oldest)

    def stats(self) -> dict[str, int]:
        return {
            "size": len(self._data),
            "hits": self.hits,
            "misses": self.misses,
            "expired": self.expired,
            "evictions": self.evictions,
            "events_applied": self.events_applied,
        }
