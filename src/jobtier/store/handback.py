"""Claims whose replies never reached their caller: the jobs they leased, given back.

A claim's reply can be lost after claim.lua ran: its connection died (a failover), or its
caller was cancelled while the reply was on its way (a worker stopped mid-claim). The jobs it
leased are then leased to a caller that will never start them, and would wait for their lease
to expire. Sent again asking for no job (``claim_replay``), the claim's token answers the jobs
it leased, and leases none if it never ran; ``stopped.lua`` then gives them back to the front
of their queues, their attempt not counted, each fenced by its lease version (a job already
back, or leased again since, is left as it is).
"""

from __future__ import annotations

from collections.abc import Sequence

from jobtier.core.errors import Code
from jobtier.core.model import ClaimedJob
from jobtier.store.calls import Call, claim_replay, parse_claim, parse_pairs, stopped_call
from jobtier.store.redis import sent_once
from jobtier.store.scripts import Scripts


async def leased_by(scripts: Scripts, call: Call) -> list[ClaimedJob]:
    """The jobs ``call`` (a ``claim_call``) leased, none if it never ran. Raises what the
    replay's send raised (sent once: its own retry could hide that it ran)."""
    replay = claim_replay(call)
    with sent_once():
        (reply,) = await scripts.call_many_each([replay])
    if isinstance(reply, BaseException):
        raise reply
    return parse_claim(call[1], reply).jobs


async def give_back(
    scripts: Scripts, shard: int, worker: str, retention_s: int, jobs: Sequence[ClaimedJob]
) -> int:
    """Release ``jobs`` (leased on ``shard`` to ``worker``, never started) to the front of
    their queues, the oldest of the claim first; how many were released. ``retention_s``: of
    a job found cancelled meanwhile (stopped.lua ends it)."""
    if not jobs:
        return 0
    # the oldest first in the claim: pushed to the front in reverse, they keep that order (a
    # job under a concurrency key lets the next one it held go first, as any release does)
    items = [(job.id, job.lease_version) for job in reversed(jobs)]
    (reply,) = await scripts.call_many([stopped_call(shard, worker, retention_s, items)])
    return sum(code is Code.OK for code, _ in parse_pairs(reply))


async def hand_back(scripts: Scripts, call: Call, worker: str, retention_s: int) -> tuple[int, int]:
    """``leased_by`` then ``give_back``, at once: (jobs the claim leased, jobs released)."""
    jobs = await leased_by(scripts, call)
    return len(jobs), await give_back(scripts, call[1], worker, retention_s, jobs)
