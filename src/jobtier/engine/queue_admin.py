"""Administering queues: their state, pause and resume, purge, flow limits, and the live
workers."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import msgspec

from jobtier.core.errors import InvalidRequest
from jobtier.core.model import PRIORITIES, QueueLimits
from jobtier.core.names import QUEUE_NAME_RE
from jobtier.engine.validate import check_name
from jobtier.store import format as job_format
from jobtier.store.calls import parse_purge, purge_call
from jobtier.store.context import Store, block_queue
from jobtier.store.redis import read_live

_limits_decoder = msgspec.json.Decoder(QueueLimits)
WORKER_FRESH_SECONDS = 60.0  # a worker advertises itself every third of a lease
WORKER_FORGET_SECONDS = 900.0  # the entry of a worker gone this long is deleted
PURGE_BATCH = 500  # jobs per purge.lua call: a short run of Redis time
# tenants of one (shard, queue, priority) rotation whose oldest ready job oldest_queued reads:
# three pipelined commands each, for every scrape, console frame and scaling read
OLDEST_TENANTS = 10_000


@dataclass(frozen=True, slots=True)
class Purged:
    """What ``QueueAdmin.purge`` did: jobs cancelled, and the queue's ready jobs left."""

    queue: str
    cancelled: int
    remaining: int


def no_counts() -> dict[str, Any]:
    """A queue's entry in ``QueueAdmin.stats`` before any of its counts is read."""
    return {
        "queued": {p.value: 0 for p in PRIORITIES},
        "parked": 0,
        "held": 0,
        "waiting": 0,
        "running": 0,
        "paused": False,
        "limited": False,
        "blocked_until_ms": 0,
    }


def _check_queue(queue: str) -> None:
    check_name("queue", queue, QUEUE_NAME_RE, 70, "queue")


class QueueAdmin:
    """Every queue of one deployment, across its shards."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def _each_shard(self, *command: Any, wake: str = "") -> list[Any]:
        """``command`` (a hash command, its field and values) on every shard's queue counts,
        then ``wake`` published to every shard's workers, in one round trip."""
        keys = self.store.keys
        pipe = self.store.redis.pipeline(transaction=False)
        for shard in range(keys.shards if command else 0):
            pipe.execute_command(command[0], keys.queue_counts(shard), *command[1:])
        for shard in range(keys.shards if wake else 0):
            pipe.execute_command("SPUBLISH", keys.wake(shard), wake)
        return await pipe.execute()

    async def stats(self) -> dict[str, Any]:
        """Jobs by state, per shard, per queue and in total.

        ``total``: ``queued`` (and ``queued_<priority>``), ``parked`` (handed back by a worker
        that cannot run them), ``held`` (queued behind their concurrency keys, in no ready
        list), ``waiting`` (for their dependencies), ``scheduled``, ``running``, ``dead``.
        ``queues``: per queue, ready jobs by priority, ``parked``, ``held``, ``waiting``,
        ``running`` and ``paused``. ``shards``: per shard, ready jobs by priority and the
        waiting, held, scheduled, running and dead counts.
        """
        keys = self.store.keys
        pipe = self.store.redis.pipeline(transaction=False)
        for shard in range(keys.shards):
            pipe.hgetall(keys.queue_counts(shard))
            pipe.hgetall(keys.parked(shard))
            pipe.zcard(keys.sched(shard))
            pipe.zcard(keys.active(shard))
            pipe.zcard(keys.dead(shard))
        values = await pipe.execute()
        total: dict[str, int] = defaultdict(int)
        queues: dict[str, dict[str, Any]] = {}

        def queue_entry(name: str) -> dict[str, Any]:
            if name not in queues:
                queues[name] = no_counts()
            return queues[name]

        shards = []
        for shard in range(keys.shards):
            counts, parked, scheduled, running, dead = values[shard * 5 : shard * 5 + 5]
            by_priority = {p.value: 0 for p in PRIORITIES}
            row: dict[str, Any] = {"shard": shard, "queued": by_priority, "waiting": 0, "held": 0}
            row.update(scheduled=scheduled, running=running, dead=dead)
            for raw_field, raw_value in counts.items():
                name, _, what = raw_field.decode().rpartition(":")
                entry = queue_entry(name)
                if what in by_priority:
                    n = max(int(raw_value), 0)
                    entry["queued"][what] += n
                    by_priority[what] += n
                elif what in ("running", "waiting", "held"):
                    entry[what] += max(int(raw_value), 0)
                    if what in ("waiting", "held"):
                        row[what] += max(int(raw_value), 0)
                elif what in ("paused", "limited"):
                    entry[what] = entry[what] or raw_value == b"1"
                elif what == "blocked":
                    entry["blocked_until_ms"] = max(entry["blocked_until_ms"], int(raw_value))
            for raw_field, raw_value in parked.items():
                name = raw_field.decode().split(":", 1)[0]
                queue_entry(name)["parked"] += max(int(raw_value), 0)
                total["parked"] += max(int(raw_value), 0)
            shards.append(row)
            total["waiting"] += row["waiting"]
            total["held"] += row["held"]
            for p, n in by_priority.items():
                total[f"queued_{p}"] += n
            total["scheduled"] += scheduled
            total["running"] += running
            total["dead"] += dead
        total["queued"] = sum(total[f"queued_{p}"] for p in PRIORITIES)
        total.setdefault("parked", 0)
        return {"total": dict(total), "queues": dict(sorted(queues.items())), "shards": shards}

    async def oldest_queued(self, tenants: int = OLDEST_TENANTS) -> dict[tuple[str, str], float]:
        """Seconds the oldest ready job of each (queue, priority) has waited (since it became
        ready): the oldest of each tenant's oldest, for the first ``tenants`` tenants of each
        rotation. Claims send the tenant they served to the back of the rotation, so the
        oldest job may be anyone's: all are read up to the bound, beyond which the age is a
        lower bound."""
        keys, redis = self.store.keys, self.store.redis
        rings: list[tuple[int, str, str]] = []
        for shard, counts in enumerate(await self._each_shard("HGETALL")):
            for raw_field, raw_value in counts.items():
                name, _, what = raw_field.decode().rpartition(":")
                if what in PRIORITIES and int(raw_value) > 0:
                    rings.append((shard, name, what))
        if not rings:
            return {}
        pipe = redis.pipeline(transaction=False)
        for shard, name, prio in rings:
            pipe.lrange(keys.ring(shard, name, prio), 0, tenants - 1)
        heads: list[tuple[int, str, str]] = []
        pipe2 = redis.pipeline(transaction=False)
        for (shard, name, prio), members in zip(rings, await pipe.execute(), strict=True):
            for tenant in members:
                pipe2.lindex(keys.ready(shard, name, prio, tenant.decode()), -1)
                heads.append((shard, name, prio))
        ids = await pipe2.execute() if heads else []
        pipe3 = redis.pipeline(transaction=False)
        found = []
        for (shard, name, prio), job_id in zip(heads, ids, strict=True):
            if job_id is not None:
                pipe3.hmget(keys.job_in(shard, job_id.decode()), job_format.small_fields("updated"))
                found.append((name, prio))
        now = time.time() * 1000
        out: dict[tuple[str, str], float] = {}
        for key, values in zip(found, await pipe3.execute() if found else [], strict=True):
            updated = job_format.small_field(values, "updated")
            if updated is not None:
                out[key] = max(out.get(key, 0.0), (now - int(updated)) / 1000)
        return out

    async def live_workers(self) -> list[dict[str, Any]]:
        """Workers that advertised themselves lately (every third of a lease), newest first.

        A worker killed without signing off stops advertising: it is no longer live after
        ``WORKER_FRESH_SECONDS`` and its entry is deleted after ``WORKER_FORGET_SECONDS``."""

        def seen(raw: bytes) -> tuple[dict[str, Any], float]:
            info = msgspec.json.decode(raw)
            return info, float(info.get("seen_at", 0))

        key = self.store.keys.workers()
        fresh, forget = WORKER_FRESH_SECONDS, WORKER_FORGET_SECONDS
        live = await read_live(self.store.redis, key, seen, fresh, forget)
        live.sort(key=lambda w: -float(w.get("seen_at", 0)))
        return live

    async def pause(self, queue: str) -> None:
        """Stop every claim from ``queue``: submits are still accepted, running jobs finish.
        Once this returns no worker claims from it (the flag is in every shard)."""
        _check_queue(queue)
        await self._each_shard("HSET", f"{queue}:paused", "1")

    async def resume(self, queue: str) -> None:
        """Let workers claim from ``queue`` again (and wake those that sleep)."""
        _check_queue(queue)
        await self._each_shard("HDEL", f"{queue}:paused", wake=f"q {queue}")

    async def unblock(self, queue: str) -> int:
        """Lift ``block`` before its end (a ``RateLimited`` a partner asked for; an operator
        knows better), its permits' too if the queue is limited, and wake the workers; a
        pause stays. Returns the end lifted (ms since the epoch; 0: none was set)."""
        _check_queue(queue)
        field, keys = f"{queue}:blocked", self.store.keys
        pipe = self.store.redis.pipeline(transaction=False)
        for shard in range(keys.shards):
            pipe.hget(keys.queue_counts(shard), field)
        pipe.hget(keys.limit(queue), "blocked")
        ends = [int(float(v)) for v in await pipe.execute() if v]
        await self.store.redis.hdel(keys.limit(queue), "blocked")
        await self._each_shard("HDEL", field, wake=f"q {queue}")
        return max(ends, default=0)

    async def purge(self, queue: str, *, batch: int = PURGE_BATCH) -> Purged:
        """Cancel every ready (or parked) job of ``queue``, oldest first, in every shard, each
        as a cancel would (logged: Postgres sees it cancelled).

        A script call takes at most ``batch`` jobs out of one shard (Redis serves others
        between calls); the shards go side by side. Jobs submitted meanwhile are left, as are
        scheduled and running ones: ``remaining`` counts the ready jobs left (jobs held behind
        a concurrency key are admitted as the purged ones leave, and stay)."""
        _check_queue(queue)
        if not 1 <= batch <= 10_000:
            raise InvalidRequest("batch must be between 1 and 10000", field="batch")
        budgets = dict.fromkeys(range(self.store.keys.shards), -1)
        left: dict[int, int] = {}
        cancelled = 0
        ttl = self.store.settings.retention_seconds
        while budgets:
            shards = list(budgets)
            calls = [purge_call(s, queue, batch, budgets[s], ttl) for s in shards]
            for shard, reply in zip(shards, await self.store.scripts.call_many(calls), strict=True):
                done, taken, budget, left[shard] = parse_purge(reply)
                cancelled += done
                if budget <= 0 or taken == 0:  # nothing taken: the lists were empty
                    del budgets[shard]
                else:
                    budgets[shard] = budget
        return Purged(queue, cancelled, sum(left.values()))

    async def set_limits(self, queue: str, limits: QueueLimits) -> QueueLimits:
        """Limit ``queue`` across every worker (or lift its limits: ``QueueLimits()``). Jobs
        already running when a limit is set finish outside it."""
        _check_queue(queue)
        if limits.concurrency is not None and not 1 <= limits.concurrency <= 1_000_000:
            raise InvalidRequest("concurrency must be between 1 and 1000000", field="concurrency")
        if limits.rate is not None and not 1 <= limits.rate <= 1_000_000:
            raise InvalidRequest("rate must be between 1 and 1000000", field="rate")
        if not 0.001 <= limits.per <= 86_400:
            raise InvalidRequest("per must be between 0.001 and 86400 seconds", field="per")
        keys, redis = self.store.keys, self.store.redis
        conf = keys.limit(queue)
        if limits.limited:
            period = None if limits.rate is None else round(limits.per * 1000)
            values = {"concurrency": limits.concurrency, "rate": limits.rate, "period": period}
            fields = {name: v for name, v in values.items() if v is not None}
            gone = [name for name, v in values.items() if v is None]
            # enforced first (the home shard's permits: limit.lua), then announced to workers
            # (the catalogue), then required in every shard: a claim without permits (from a
            # worker that has not heard yet) takes nothing from it
            await redis.hset(conf, mapping=fields)  # type: ignore[arg-type]
            if gone:
                await redis.hdel(conf, *gone)
            await redis.hset(keys.queue_limits(), queue, msgspec.json.encode(limits))
            await self._each_shard("HSET", f"{queue}:limited", "1")
        else:
            await self._each_shard("HDEL", f"{queue}:limited")
            await redis.hdel(keys.queue_limits(), queue)
            await redis.hdel(conf, "concurrency", "rate", "period")
            await self._each_shard(wake=f"q {queue}")
        return limits

    async def limits(self) -> dict[str, QueueLimits]:
        """Every limited queue's limits."""
        raw = await self.store.redis.hgetall(self.store.keys.queue_limits())
        return {
            (name.decode() if isinstance(name, bytes) else name): _limits_decoder.decode(value)
            for name, value in sorted(raw.items())
        }

    async def running_permits(self, queue: str) -> int:
        """Permits held now for a limited queue: its jobs running under the limit."""
        return int(await self.store.redis.zcard(self.store.keys.permits(queue)))

    async def block(self, queue: str, seconds: float) -> int:
        """Start no job of ``queue`` for ``seconds`` (a task raised ``RateLimited``): every
        shard's claims skip it until then, its permits' too if it is limited
        (``block_queue``). Returns when the block ends, ms since the epoch."""
        _check_queue(queue)
        return await block_queue(self.store, queue, seconds)

    async def waiting_by_tenant(self) -> dict[str, int]:
        """Jobs not started yet (waiting, scheduled, queued) per tenant, summed over shards."""
        pipe = self.store.redis.pipeline(transaction=False)
        for shard in range(self.store.keys.shards):
            pipe.hgetall(self.store.keys.waiting(shard))
        out: dict[str, int] = defaultdict(int)
        for counts in await pipe.execute():
            for tenant, n in counts.items():
                out[tenant.decode()] += int(n)
        return dict(out)
