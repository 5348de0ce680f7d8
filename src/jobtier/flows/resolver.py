"""The resolver: tells dependents that their dependencies finished, across shards and nodes.

A job that finishes with dependents appends a hand-off to its own shard's flow stream in the
script of its transition (lib.lua ``flow_finished``): nothing about its dependents, which may
live on other shards, happens there. Resolvers read every shard's flow stream through one
consumer group, apply each hand-off on the dependent's shard (``resolve.lua``, one call per
shard, batched) and only then acknowledge and delete it. What makes that safe:

* a resolver that dies mid-batch (some dependents told, others not) leaves its hand-offs
  pending in the group; any resolver takes them over once they are idle for
  ``JOBTIER_RESOLVER_CLAIM_IDLE_SECONDS`` (XAUTOCLAIM) and applies them again, and
  ``resolve.lua`` is idempotent: a dependency resolves once, a repeated hand-off changes
  nothing. Several resolvers may run; none is a leader;
* a dependent whose submitter died before linking it (flows/submit.py) is linked by a
  resolver past its deadline (``jt:{s}:unlinked``), ``link.lua`` being idempotent too.

No polling: the finishing script publishes ``f`` on its shard's wake channel and the
scheduler, which runs the resolver, wakes it for that shard; a sweep every half claim-idle
period takes over abandoned hand-offs and overdue links. Reading, taking over and
acknowledging are its ``Consumer``'s (``streams/consumer.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jobtier.core.errors import Code
from jobtier.flows.submit import link_calls, linked_calls
from jobtier.metrics.snapshot import Snapshot
from jobtier.runtime.backoff import SCHEDULER
from jobtier.runtime.loop import FAULTS, wait_for
from jobtier.store.calls import Call, resolve_call
from jobtier.store.context import Store
from jobtier.streams.consumer import Consumer, Taken

log = logging.getLogger("jobtier.resolver")

RESOLVE_CHUNK = 1000  # hand-offs per resolve.lua call
RELINK_BATCH = 200  # overdue dependents linked per shard and sweep

Item = tuple[str, str, str, str, bytes]  # resolve.lua's: kind, target, source, state, data


@dataclass(slots=True)
class ResolverStats:
    handoffs: int = 0  # stream entries applied and acknowledged
    applied: int = 0  # dependents moved (a dependency resolved, a child cancelled)
    repeated: int = 0  # hand-offs applied before (a resolver died before acknowledging)
    moot: int = 0  # hand-offs whose target no longer waited (resolved, cancelled, gone)
    claimed: int = 0  # entries taken over from idle consumers
    relinked: int = 0  # dependents linked past their deadline (their submitter died)
    passes: int = 0


class Resolver:
    """One member of the resolvers' consumer group; ``await run()`` until ``stop()``.

    The scheduler runs one and forwards its wake messages (``notify``) and subscription
    resets (``reset``); tests call ``run_once`` / ``drain`` directly.
    """

    def __init__(self, store: Store, *, name: str | None = None, batch: int = 500) -> None:
        self.store = store
        self.keys = store.keys
        self.scripts = store.scripts
        self.settings = store.settings
        self.redis = store.redis
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(2).hex()}"
        self.batch = batch
        idle = self.settings.resolver_claim_idle_seconds
        self.sweep_every = max(0.05, idle / 2)
        self.stats = ResolverStats()
        n = self.keys.shards
        # hand-offs are deleted once applied: no group but this one reads the flow streams
        self.consumer = Consumer(
            store.redis,
            [self.keys.flow(s) for s in range(n)],
            self.keys.resolver_group(),
            self.name,
            claim_idle_ms=max(1, int(idle * 1000)),
            log=log,
            counts=self.stats,
            claimed_event="handoffs_taken_over",
            policy=SCHEDULER,
            delete=True,
        )
        self._dirty: set[int] = set(range(n))
        self._wake = asyncio.Event()
        self._next_sweep = 0.0

    # --- life cycle -----------------------------------------------------------------------
    def notify(self, shard: int) -> None:
        """Hand-offs were added to ``shard``'s stream."""
        self._dirty.add(shard)
        self._wake.set()

    def reset(self) -> None:
        """Wake messages may have been missed: look at every shard."""
        self._dirty = set(range(self.keys.shards))
        self._wake.set()

    def stop(self) -> None:
        self.consumer.stop()
        self._wake.set()

    def metrics(self) -> Snapshot:
        names = ("handoffs", "applied", "repeated", "moot", "claimed", "relinked")
        counters = {f"resolver_{n}_total": {"": getattr(self.stats, n)} for n in names}
        return Snapshot("", "", 0.0, counters=counters)

    async def run(self) -> ResolverStats:
        log.info("event=resolver_started name=%s shards=%d", self.name, self.keys.shards)
        # a pass that failed for a bug leaves its hand-offs pending (the sweep takes them up
        # again); reading them back at once would hold up every later one behind them
        await self.consumer.run(
            self.run_once, self._failed, idle=self._idle, reread_after_bug=False
        )
        log.info(
            "event=resolver_stopped name=%s handoffs=%d applied=%d",
            self.name,
            self.stats.handoffs,
            self.stats.applied,
        )
        return self.stats

    def _failed(self, exc: Exception, wait: float) -> bool:
        self.reset()  # wake messages may have been missed meanwhile
        if isinstance(exc, FAULTS):
            log.warning("event=resolver_pass_failed error=%r retry_in=%.2fs", exc, wait)
            return True  # a restarted Redis may have lost the group
        # a bug: the hand-offs stay pending; keep resolving the others
        log.error("event=resolver_pass_crashed retry_in=%.2fs", wait, exc_info=exc)
        return False

    async def _idle(self) -> None:
        """Nothing applied: wait for a wake message, or the next sweep."""
        if not self._dirty:
            await wait_for(self._wake, self._next_sweep - time.monotonic())

    # --- one pass ---------------------------------------------------------------------------
    async def run_once(self) -> int:
        """Apply what the woken shards hold (and, when due, what is abandoned or overdue);
        returns the hand-offs applied."""
        if not self.consumer.ready:
            await self.consumer.setup()
        self.stats.passes += 1
        moved = 0
        if time.monotonic() >= self._next_sweep:
            # hand-offs idle past the claim timeout: their resolver died before acknowledging
            self._next_sweep = time.monotonic() + self.sweep_every
            moved += await self.apply(await self.consumer.claim(self.batch))
            if not self.consumer.swept:
                self._next_sweep = 0.0  # more may be abandoned: the next pass looks
            self.stats.relinked += await self.relink()
        self._wake.clear()
        shards = sorted(self._dirty)
        self._dirty.clear()
        if shards:
            more, entries = await self.consumer.read(self.batch, shards)
            self._dirty.update(more)  # more may be waiting there
            moved += await self.apply(entries)
        return moved

    async def drain(self) -> int:
        """Apply hand-offs until none is left, every shard looked at in each pass (no wake
        messages needed: tests, one-off runs); a sweep first, whatever its time."""
        self._next_sweep = 0.0
        total = 0
        while True:
            self.reset()
            moved = await self.run_once()
            total += moved
            if not moved and not self._dirty:  # dirty: own pending read back, new ones next
                return total

    async def apply(self, entries: Sequence[Taken]) -> int:
        """Apply hand-offs on their targets' shards, then acknowledge (and delete) them."""
        if not entries:
            return 0
        by_shard: dict[int, list[Item]] = defaultdict(list)
        batches: dict[int, list[tuple[str, str, str, bytes]]] = defaultdict(list)
        expiring: list[tuple[int, str]] = []  # (shard, batch id)
        for shard, entry_id, fields in entries:
            if not fields:  # pending but deleted from the stream: nothing left to apply
                continue
            try:
                kind, source = fields[b"k"].decode(), fields[b"j"].decode()
                state, data = fields[b"s"].decode(), fields.get(b"v", b"")
                targets = fields[b"t"].decode().split()
            except (KeyError, UnicodeDecodeError) as exc:  # never applicable: acknowledged
                log.error(
                    "event=handoff_malformed stream=%s id=%s error=%r",
                    self.keys.flow(shard),
                    entry_id.decode(),
                    exc,
                )
                continue
            if kind == "E":  # a batch finished: its shards' counts may expire now
                expiring.extend((int(s), source) for s in data.decode().split() if s.isdigit())
                continue
            if kind == "b":  # a shard's share of a batch finished (flows/batches.py)
                for target in targets:
                    if self.keys.valid_id(target):
                        batches[self.keys.shard_of(target)].append((target, source, state, data))
                continue
            for target in targets:
                if self.keys.valid_id(target):
                    by_shard[self.keys.shard_of(target)].append((kind, target, source, state, data))
        calls: list[Call] = [
            resolve_call(shard, self.settings.retention_seconds, items[i : i + RESOLVE_CHUNK])
            for shard, items in by_shard.items()
            for i in range(0, len(items), RESOLVE_CHUNK)
        ]
        retention = self.settings.retention_seconds
        for shard, done in batches.items():
            for i in range(0, len(done), RESOLVE_CHUNK):
                args: list[Any] = [retention, len(done[i : i + RESOLVE_CHUNK])]
                for item in done[i : i + RESOLVE_CHUNK]:
                    args.extend(item)
                calls.append(("batch_done", shard, args))
        if calls:
            for reply in await self.scripts.call_many(calls):
                self._count(reply)
        if expiring:
            keep = self.settings.dead_retention_seconds
            expire: list[Call] = [("batch_expire", s, (bid, keep)) for s, bid in expiring]
            await self.scripts.call_many(expire)
            self.stats.applied += len(expiring)
        await self.consumer.ack((shard, entry_id) for shard, entry_id, _ in entries)
        self.stats.handoffs += len(entries)
        return len(entries)

    def _count(self, codes: list[Any]) -> None:
        for code in codes:
            if code == Code.OK:
                self.stats.applied += 1
            elif code == Code.DUPLICATE:
                self.stats.repeated += 1
            else:  # WRONG_STATE, NOT_FOUND
                self.stats.moot += 1

    # --- reconciliation -------------------------------------------------------------------
    async def relink(self) -> int:
        """Link the dependents whose deadline passed without their submitter saying it had
        linked them (it died halfway, flows/submit.py). Returns how many."""
        now_s, now_us = await self._redis_time()
        now_ms = now_s * 1000 + now_us // 1000
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.zrangebyscore(self.keys.unlinked(shard), "-inf", now_ms, start=0, num=RELINK_BATCH)
        overdue = [member.decode() for members in await pipe.execute() for member in members]
        if not overdue:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for job_id in overdue:
            pipe.hmget(self.keys.job(job_id), "tenant", "dids")
        links: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for job_id, (tenant, ids) in zip(overdue, await pipe.execute(), strict=True):
            if tenant is None or not ids:
                continue  # gone (expired) or never complete: linked.lua forgets it
            for dep in ids.decode().split():
                if self.keys.valid_id(dep):
                    links[tenant.decode()].append((dep, job_id))
        calls = [
            c for tenant, pairs in links.items() for c in link_calls(self.store, tenant, pairs)
        ]
        if calls:
            await self.scripts.call_many(calls)
        await self.scripts.call_many(linked_calls(self.store, overdue))
        log.warning(
            "event=dependents_relinked count=%d: their submit was cut short before it linked them",
            len(overdue),
        )
        return len(overdue)

    async def _redis_time(self) -> tuple[int, int]:
        reply = await self.redis.time()
        if isinstance(reply, dict):  # a cluster client answers per node
            reply = next(iter(reply.values()))
        return int(reply[0]), int(reply[1])
