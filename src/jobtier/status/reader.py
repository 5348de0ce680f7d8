"""The status read path: near cache, then per-tick coalesced Redis loads, then the fallback."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from redis.asyncio import RedisCluster

from jobtier.core.keys import Keys
from jobtier.metrics.snapshot import Snapshot
from jobtier.status.coalescer import Coalescer
from jobtier.status.docs import READ_STATUS, read_docs, read_status_args
from jobtier.status.nearcache import Entry, NearCache
from jobtier.store.redis import RedisClient
from jobtier.store.scripts import run_script
from jobtier.store.subscriber import ShardSubscriber

log = logging.getLogger("jobtier.status")

Status = tuple[str, bytes, int]
"""(tenant, status document, version)."""
NOTHING: tuple[None, bytes, int] = (None, b"", 0)
"""What ``get(job_id) or NOTHING`` unpacks to for a job not found."""
Fallback = Callable[[list[str]], Awaitable[Mapping[str, tuple[str, bytes]]]]
"""Ids Redis no longer holds -> {id: (tenant, document)} for those found (Postgres)."""
Listener = Callable[[int, str, bytes], None]
"""Called with (version, tenant, document) for every published change of one job."""

RESYNC = -1
"""The version listeners get after a resubscription: re-read, events may have been missed."""

_VERSION = b'"version":'
_STATE = b'"state":"'
_TERMINAL = (b"succeeded", b"failed", b"cancelled")
_SHARD_AT = 27  # a valid id is a 26-character ULID, '-', then the shard


def parse_version(doc: bytes) -> int:
    """The ``version`` of a rendered status document, without decoding the JSON.

    The first ``"version":`` is the real key: the only string fields before it are the id
    (a validated ULID) and the type, and a quote inside the type is escaped (``\\"``).
    """
    start = doc.find(_VERSION)
    if start < 0:
        raise ValueError("status document without a version")
    start += len(_VERSION)
    end = doc.find(b",", start)
    if end < 0:
        end = doc.find(b"}", start)
    return int(doc[start:end])


def is_terminal(doc: bytes) -> bool:
    """Whether a rendered status document is in a terminal state (succeeded, failed,
    cancelled), without decoding the JSON: ``"state":"`` first occurs as the real key (the
    only string fields before it, id, type and queue, are validated names)."""
    at = doc.find(_STATE)
    return at >= 0 and doc.startswith(_TERMINAL, at + len(_STATE))


class StatusReader:
    """``get(job_id)`` for ``GET /v1/jobs/{id}``, composed for 10K+ reads a second.

    1. Near cache (``near_cache=True``): a hit returns at once, no task, no future, no I/O.
    2. A miss goes to the coalescer (``coalesce=True``): every id missed in this event-loop
       tick is read in one round trip, and concurrent misses of one id share that read: one
       call of the read-only ``read_status.lua`` (status/docs.py), which costs the client far
       less than a pipeline of HMGETs; on a cluster one call per shard, pipelined. With
       ``coalesce=False`` each miss sends its own call: the baseline the benchmarks measure.
    3. Ids Redis no longer holds go to ``fallback`` (the Postgres reader), itself coalesced
       and singleflighted, one id's fallback failing only that id's readers. An id the
       fallback does not know either is remembered as absent for ``absent_ttl`` seconds
       (at most ``absent_size`` ids): clients polling a purged or mistyped id then cost one
       Postgres query per id per ``absent_ttl``, not one per request. Redis is still asked
       first, so a job that appears meanwhile is seen at once.
    4. What was read is put into the near cache.

    Freshness: the process's shard subscription (:meth:`subscription`) calls ``on_event`` for
    every published change; it advances cached entries and calls the listeners registered
    for that id (long-poll, SSE). ``on_lost`` (a subscription broke) and ``on_reset`` (after
    a resubscription) empty the cache.

    A terminal document stored while ``events_live()`` holds (every subscription confirmed
    and answering its pings) is a final entry, kept for ``final_ttl`` (nearcache.py).

    Races it guards (besides those of the parts):

    * event during a load: a job missed (not cached), loaded, and changed while the load is
      in flight; its event finds no entry to advance and the load then stores the older
      document until the TTL. Ids being loaded are tracked, and an event for one of them is
      stored; the load's ``put`` then cannot regress it.
    * load across a resubscription: events may have been missed while the subscription was
      down, so a load that began before ``on_reset`` does not store what it read.
    """

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        *,
        near_cache: bool = True,
        coalesce: bool = True,
        cache_size: int = 100_000,
        ttl: float = 2.0,
        fallback: Fallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        timeout: float | None = 5.0,
        max_batch: int = 500,
        absent_ttl: float = 1.0,
        absent_size: int = 10_000,
        final_ttl: float | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self._clock = clock
        self.near: NearCache | None = (
            NearCache(cache_size, ttl, clock, final_ttl) if near_cache else None
        )
        # whether every event subscription is live now (see subscription); without a
        # subscriber nothing is kept past the short ttl
        self.events_live: Callable[[], bool] = lambda: False
        self.coalescer: Coalescer[str, Status] | None = (
            Coalescer(self._load, max_batch=max_batch, timeout=timeout) if coalesce else None
        )
        self._fallback = fallback
        self._absent: dict[str, float] = {}  # id -> until when the fallback's "unknown" holds
        self._absent_ttl = absent_ttl
        self._absent_size = absent_size
        self.fallback_coalescer: Coalescer[str, Status] | None = (
            Coalescer(self._load_fallback, max_batch=max_batch, timeout=timeout)
            if fallback is not None
            else None
        )
        self._listeners: dict[str, set[Listener]] = {}
        self._loading: dict[str, int] = {}  # id -> loads in flight that include it
        self._polls: set[asyncio.Future[None]] = set()  # long polls waiting (``wait_past``)
        self._polls_ended = False  # the API is stopping: long polls answer at once
        self._cluster = isinstance(redis, RedisCluster)
        self.requests = 0
        self.near_hits = 0
        self.redis_loads = 0  # job hashes read (by read_status.lua, alone or in a batch)
        self.batches = 0  # round trips (a single HMGET, one script call or one pipeline)
        self.script_calls = 0  # read_status.lua calls answered (each reads many hashes)
        self.fallback_loads = 0  # ids asked of the fallback
        self.absent_hits = 0  # reads answered "unknown" from the remembered absent ids

    # --- reads --------------------------------------------------------------------------
    def near_hit(self, job_id: str) -> Entry | None:
        """The near cache's entry for ``job_id``, counted as a request, or None: then
        :meth:`load` answers (and counts) it. ``get`` in two steps, for a caller that
        answers most reads without a coroutine (fastpath.py)."""
        near = self.near
        if near is not None:
            entry = near.get(job_id, self._clock())
            if entry is not None:
                self.requests += 1
                self.near_hits += 1
                return entry
        return None

    async def get(self, job_id: str) -> Status | None:
        """(tenant, document, version), or None for an unknown (or malformed) id.

        The caller compares the tenant: another tenant's job must look unknown.
        """
        entry = self.near_hit(job_id)
        if entry is not None:
            return entry.tenant, entry.doc, entry.version
        return await self.load(job_id)

    async def get_for(self, job_id: str, tenant: str) -> Status | None:
        """``get``, None also for another tenant's job."""
        found = await self.get(job_id)
        return found if found is not None and found[0] == tenant else None

    async def wait_past(
        self, job_id: str, tenant: str, version: int, timeout: float
    ) -> Status | None:
        """The job's status (``get_for``) as soon as a read finds it past ``version`` or
        gone, or as last read at the timeout (long-poll), or once ``end_polls()`` is called."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        changed: asyncio.Future[None] = loop.create_future()

        def listener(new: int, _tenant: str, _doc: bytes) -> None:
            if (new > version or new == RESYNC) and not changed.done():
                changed.set_result(None)

        self.add_listener(job_id, listener)
        try:
            while True:
                # read after registering: a change since the caller's read is not lost
                found = await self.get_for(job_id, tenant)
                left = deadline - loop.time()
                if found is None or found[2] > version or left <= 0 or self._polls_ended:
                    return found
                self._polls.add(changed)
                try:
                    async with asyncio.timeout(left):
                        await asyncio.shield(changed)
                except TimeoutError:
                    return found
                finally:
                    self._polls.discard(changed)
                changed = loop.create_future()
        finally:
            self.remove_listener(job_id, listener)

    def end_polls(self) -> None:
        """The API is stopping: every long poll answers now with what it has (its client polls
        again, another API), as at its timeout; later ones do not wait."""
        self._polls_ended = True
        for changed in self._polls:
            if not changed.done():
                changed.set_result(None)

    async def load(self, job_id: str) -> Status | None:
        """``get`` past the near cache: after ``near_hit`` gave None (Redis, coalesced; then
        the fallback). The id counts as loading throughout (``_loading``): an event that
        arrives meanwhile is kept (``on_event``), not lost to the older document the load then
        caches (see the class docstring; the job may reach Redis while the fallback answers,
        an outbox row relayed: the fallback's document is its version 0)."""
        self.requests += 1
        if not self.keys.valid_id(job_id):
            return None  # never sent to Redis: one bad key in a batch would fail the batch
        loading = self._loading
        loading[job_id] = loading.get(job_id, 0) + 1
        try:
            status = await self._load_redis(job_id)
            if status is None and self.fallback_coalescer is not None:
                until = self._absent.get(job_id)
                if until is not None:
                    if until > self._clock():
                        self.absent_hits += 1
                        return None
                    del self._absent[job_id]
                status = await self.fallback_coalescer.get(job_id)
            return status
        finally:
            left = loading[job_id] - 1
            if left:
                loading[job_id] = left
            else:
                del loading[job_id]

    async def _load_redis(self, job_id: str) -> Status | None:
        if self.coalescer is not None:
            return await self.coalescer.get(job_id)
        loaded = (await self._load([job_id])).get(job_id)
        if isinstance(loaded, BaseException):
            raise loaded
        return loaded

    async def _load(self, ids: list[str]) -> dict[str, Status | BaseException]:
        """The tenant and document of every id in one round trip (read_status.lua); cache what
        was found. An id of a cluster node that failed maps to the exception: the reads of
        that node's shards fail (a 503), the others are answered."""
        near = self.near
        generation = near.generation if near is not None else 0
        replies = await self._fetch(ids)  # (each id counts as loading: ``load`` marks it)
        found: dict[str, Status] = {}
        failed: dict[str, BaseException] = {}
        for job_id, reply in zip(ids, replies, strict=True):
            if isinstance(reply, BaseException):
                failed[job_id] = reply
                continue
            tenant, doc = reply
            if tenant and doc:  # None for a missing job (False from the script on RESP3)
                found[job_id] = (tenant.decode(), doc, parse_version(doc))
        if near is not None and near.generation == generation:
            self._store(near, found)
        return {**found, **failed}

    async def _fetch(self, ids: list[str]) -> list[Any]:
        """(tenant, document) of each id, in order; (None, None) for a job Redis lacks."""
        keys = self.keys
        self.batches += 1
        self.redis_loads += len(ids)
        if len(ids) == 1 or not self._cluster:
            # one server: one call for the batch, whatever shards (hash tags) its keys carry
            job_keys = [keys.job_in(int(i[_SHARD_AT:]), i) for i in ids]
            flat = await run_script(self.redis, READ_STATUS, read_status_args(job_keys))
            self.script_calls += 1
            return list(zip(flat[0::2], flat[1::2], strict=True))
        # a cluster: one call per shard (a script's keys share a slot), in one pipeline
        found = await read_docs(self.redis, keys, ids, each=True)
        self.script_calls += len({job_id[_SHARD_AT:] for job_id in ids})
        return found

    async def _load_fallback(self, ids: list[str]) -> dict[str, Status]:
        assert self._fallback is not None
        near = self.near
        generation = near.generation if near is not None else 0
        self.fallback_loads += len(ids)
        found = {
            job_id: (tenant, doc, parse_version(doc))
            for job_id, (tenant, doc) in (await self._fallback(ids)).items()
        }
        if near is not None and near.generation == generation:
            self._store(near, found)
        absent, until = self._absent, self._clock() + self._absent_ttl
        for job_id in ids:
            if job_id not in found:
                absent.pop(job_id, None)  # re-inserted last: the dict's order is expiry order
                absent[job_id] = until
        while len(absent) > self._absent_size:
            del absent[next(iter(absent))]  # the oldest first
        return found

    def _store(self, near: NearCache, found: dict[str, Status]) -> None:
        now = self._clock()
        live = self.events_live()
        for job_id, (tenant, doc, version) in found.items():
            near.put(job_id, Entry(tenant, version, doc, now, live and is_terminal(doc)))

    # --- events -------------------------------------------------------------------------
    def on_event(self, channel: bytes, data: bytes) -> None:
        """Shard-channel callback: ``b"<id> <version> <tenant>\\n<document>"``."""
        try:
            head, _, doc = data.partition(b"\n")
            raw_id, raw_version, raw_tenant = head.split(b" ", 2)
            job_id = raw_id.decode()
            version = int(raw_version)
            tenant = raw_tenant.decode()
        except ValueError:  # UnicodeDecodeError included
            log.warning("event=bad_status_event channel=%r data=%r", channel, data[:120])
            return
        near = self.near
        if near is not None:
            final = is_terminal(doc) and self.events_live()
            if not near.on_event(job_id, version, tenant, doc, final) and job_id in self._loading:
                # event during a load (see the class docstring): keep the newer document
                near.put(job_id, Entry(tenant, version, doc, self._clock(), final))
        listeners = self._listeners.get(job_id)
        if listeners:
            for listener in tuple(listeners):  # a listener may remove itself
                try:
                    listener(version, tenant, doc)
                except Exception:
                    # one broken listener must not stop the subscription loop or the others
                    log.exception("event=status_listener_failed job=%s", job_id)

    def on_lost(self) -> None:
        """A subscription broke: events may be missed from now until it is back (on_reset),
        so nothing cached may be trusted past its next read; loads in flight do not store."""
        if self.near is not None:
            self.near.clear()

    def on_reset(self) -> None:
        """The subscription was (re)established: events may have been missed.

        The cache is emptied, and every listener is called once with version ``RESYNC``
        (-1): it must read the job again rather than wait for an event that may be lost.
        """
        if self.near is not None:
            self.near.clear()
        for job_id, listeners in list(self._listeners.items()):
            for listener in tuple(listeners):
                try:
                    listener(RESYNC, "", b"")
                except Exception:
                    log.exception("event=status_listener_failed job=%s", job_id)

    def subscription(self, name: str) -> ShardSubscriber:
        """The shard subscription that keeps this reader fresh (one a process; start it)."""
        keys = self.keys
        subscriber = ShardSubscriber(
            self.redis,
            [keys.events(shard) for shard in range(keys.shards)],
            self.on_event,
            self.on_reset,
            name=name,
            on_lost=self.on_lost,
        )
        self.events_live = subscriber.live
        return subscriber

    def add_listener(self, job_id: str, callback: Listener) -> None:
        self._listeners.setdefault(job_id, set()).add(callback)

    def remove_listener(self, job_id: str, callback: Listener) -> None:
        listeners = self._listeners.get(job_id)
        if listeners is not None:
            listeners.discard(callback)
            if not listeners:
                del self._listeners[job_id]

    # --- metrics ------------------------------------------------------------------------
    def metrics(self) -> Snapshot:
        """This reader's part of its API process's metrics snapshot."""
        s = self.stats()
        return Snapshot(
            "", "", 0.0,
            counters={
                "status_requests_total": {"": s["requests"]},
                "status_near_cache_hits_total": {"": s["near_hits"]},
                "status_redis_loads_total": {"": s["redis_loads"]},
                "status_redis_round_trips_total": {"": s["batches"]},
                "status_fallback_loads_total": {"": s["fallback_loads"]},
            },
            gauges={
                "status_listeners": {"": s["listeners"]},
                "near_cache_entries": {"": s.get("near_size", 0)},
            },
        )  # fmt: skip

    def stats(self) -> dict[str, float]:
        """Counters for the metrics endpoint (monotonic, except sizes)."""
        out: dict[str, float] = {
            "requests": self.requests,
            "near_hits": self.near_hits,
            "redis_loads": self.redis_loads,
            "batches": self.batches,
            "script_calls": self.script_calls,
            "fallback_loads": self.fallback_loads,
            "absent_hits": self.absent_hits,
            "listeners": sum(len(s) for s in self._listeners.values()),
        }
        if self.near is not None:
            out.update({f"near_{k}": v for k, v in self.near.stats().items()})
        if self.coalescer is not None:
            c = self.coalescer
            out.update(
                coalesced_requests=c.requests,
                coalesced_joined=c.joined,
                coalesced_batches=c.batches,
                coalesced_keys=c.keys_loaded,
                coalesced_max_batch=c.max_batch_size,
            )
        return out
