"""The HTTP workers' claims (api/worker_claims.py) when Redis fails between two rounds of one
claim: the jobs the first round leased are answered, not left leased to nobody."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier.api.worker_claims import WorkerClaims, _Waiter
from jobtier.core.model import JobSpec, State
from jobtier.engine.queue import Queue
from jobtier.store.calls import Call
from jobtier.store.scripts import Scripts


class FailingSecondRound:
    """The scripts, but the second pipelined round of claims fails (Redis went away)."""

    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.rounds = 0

    async def call_many(self, calls: Sequence[Call]) -> list[Any]:
        self.rounds += 1
        if self.rounds == 2:
            raise RedisConnectionError("Connection closed by server.")
        return await self.scripts.call_many(calls)


class OneShardAtATime(WorkerClaims):
    """Rounds of one job of one shard each, so that a claim of 2 takes two rounds."""

    shard = 0

    def _plan(self, w: _Waiter, want: int) -> list[tuple[int, int]]:
        return [(self.shard, 1)]


async def test_jobs_an_earlier_round_leased_are_answered_when_a_later_round_fails(
    queue: Queue,
) -> None:
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(5)])
    # five jobs over four shards: one shard holds two
    shard, n = Counter(queue.keys.shard_of(s.job_id) for s in subs).most_common(1)[0]
    assert n >= 2
    scripts = FailingSecondRound(queue.scripts)
    claims = OneShardAtATime(queue.redis, queue.keys, cast(Scripts, scripts))
    claims.shard = shard
    got = await claims.claim("http-w", (), ["default"], 2, 30_000, 0.0, _never_gone)
    assert scripts.rounds == 2  # the second round was tried, and failed
    assert len(got) == 1
    status = await queue.status(got[0].job.id)
    assert status.state is State.RUNNING and status.worker == "http-w"


async def _never_gone() -> bool:
    return False
