"""The engine context: one deployment's Redis, its key layout and its scripts.

Every part that talks to Redis (producer, job and queue operations, workers, the scheduler,
the resolver) holds the ``Store`` it was given; only its owner closes it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.runtime import tracing
from jobtier.store import format as job_format
from jobtier.store.calls import Call, SubmitItem, SubmitOutcome, parse_submit, submit_call
from jobtier.store.fitness import check_redis
from jobtier.store.keyed_calls import submit_keyed
from jobtier.store.redis import RedisClient, connect
from jobtier.store.scripts import Script, Scripts, run_scripts

log = logging.getLogger("jobtier.redis")
_BLOCK = Script("queue_block")


class Store:
    __slots__ = ("keyring", "keys", "redis", "scripts", "settings")

    def __init__(self, settings: Settings, redis: RedisClient) -> None:
        self.settings = settings
        # the keys that seal and open payloads and results (docs/encryption.md); None: none
        self.keyring = settings.keyring()
        self.redis = redis
        self.keys = Keys(settings.prefix, settings.shards)
        self.scripts = Scripts(redis, self.keys)

    @classmethod
    async def connect(cls, settings: Settings, *, check: bool = True) -> Store:
        """Connect, check that Redis is fit (non-evicting, AOF), load the scripts, and check
        that the job hashes are in the format they read (``store/format.py``)."""
        store = cls(settings, connect(settings))
        try:
            if check:
                for warning in await check_redis(store.redis, settings):
                    log.warning("event=redis_warning: %s", warning)
            await store.scripts.load()
            await job_format.adopt(store.redis, store.keys)
        except BaseException:
            await store.close()
            raise
        return store

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


SPREAD_FROM = 128  # jobs in a submit from which its shards go in several pipelines


def submit_calls(
    store: Store, items: Sequence[SubmitItem], chunk: int = 0
) -> tuple[list[Call], list[list[int]]]:
    """One submit call per shard (per ``chunk`` jobs of a shard, when given); with each, the
    indices of its items. Inside a traced span, the jobs keep its traceparent
    (runtime/tracing.py)."""
    by_shard: dict[int, list[int]] = defaultdict(list)
    for i, item in enumerate(items):
        by_shard[store.keys.shard_of(item.job_id)].append(i)
    ttl = store.settings.idempotency_ttl_seconds * 1000
    trace = tracing.traceparent()
    calls, groups = [], []
    for shard, idx in by_shard.items():
        step = chunk or len(idx)
        for start in range(0, len(idx), step):
            group = idx[start : start + step] if step < len(idx) else idx
            calls.append(submit_call(shard, [items[i] for i in group], ttl, trace))
            groups.append(group)
    return calls, groups


def in_order(n: int, groups: Sequence[list[int]], replies: Sequence[Any]) -> list[SubmitOutcome]:
    """The outcomes of ``n`` items from their calls' replies, in the items' order."""
    outcomes: list[SubmitOutcome | None] = [None] * n
    for idx, reply in zip(groups, replies, strict=True):
        for i, outcome in zip(idx, parse_submit(reply), strict=True):
            outcomes[i] = outcome
    return [o for o in outcomes if o is not None]


async def submit_items(store: Store, items: Sequence[SubmitItem]) -> list[SubmitOutcome]:
    """Run submits already validated: one script call per shard, pipelined; outcomes in
    order."""
    if items and items[0].keyed is not None:  # alone in its submit (engine/keyed.py)
        item, ttl = items[0], store.settings.idempotency_ttl_seconds * 1000
        return [await submit_keyed(store.scripts, store.keys.shard_of(item.job_id), item, ttl)]
    calls, groups = submit_calls(store, items)
    # a large batch's shards in four pipelines sent in turn: Redis runs the first while the
    # others are packed (Scripts.call_spread)
    per = -(-len(calls) // 4) if len(items) >= SPREAD_FROM else len(calls)
    return in_order(len(items), groups, await store.scripts.call_spread(calls, per))


async def block_queue(store: Store, queue: str, seconds: float, limited: bool | None = None) -> int:
    """Start no job of ``queue`` for ``seconds`` (a task raised ``RateLimited``; an HTTP
    worker held a job with ``block_queue``): every shard's claims skip it until then, by
    Redis's clock; a later end set already stands (queue_block.lua); at most
    JOBTIER_MAX_FUTURE_SECONDS. A limited queue's permits wait as long (limit.lua):
    ``limited`` says whether the queue is (None: looked up). Returns when the block ends, ms
    since the epoch (the latest of the shards')."""
    ms = round(min(seconds, store.settings.max_future_seconds) * 1000)
    field = f"{queue}:blocked"
    keys = store.keys
    calls = [(_BLOCK, (1, keys.queue_counts(s), field, ms)) for s in range(keys.shards)]
    until = max(int(v) for v in await run_scripts(store.redis, calls))
    if limited is None:
        limited = bool(await store.redis.hexists(keys.queue_limits(), queue))
    if limited:
        await store.scripts.call("limit", keys.home(queue), ("block", queue, ms))
    return until
