"""What the flow tests share: running a flow to its end without timing, and reading what
happened to a job from its shard's transition log."""

from __future__ import annotations

from jobtier.core.model import JobStatus, decode_status
from jobtier.engine.queue import Queue
from jobtier.flows.resolver import Resolver
from tests.fixtures.engine import worker_for
from tests.fixtures.redis import logged
from tests.tasks import registry


async def run_flows(queue: Queue, resolver: Resolver | None = None, rounds: int = 50) -> None:
    """Run burst workers and resolver passes in turn until neither finds anything to do:
    each round drains the ready jobs, then applies every hand-off their ends made."""
    resolver = resolver or Resolver(queue.store, name="test-resolver")
    for _ in range(rounds):
        stats = await worker_for(queue, registry, burst=True).run()
        moved = await resolver.drain()
        if not moved and not stats.claimed:
            return
    raise AssertionError(f"flows still moving after {rounds} rounds")


async def transitions(queue: Queue, job_id: str) -> list[tuple[str, str]]:
    """(from, to) of every logged change of the job, in order ('' from: its submit)."""
    shard = queue.keys.shard_of(job_id)
    out = []
    for fields in await logged(queue.redis, queue.keys.log(shard)):
        doc = decode_status(fields[b"d"])
        if doc.id == job_id:
            out.append((fields[b"fr"].decode(), doc.state.value))
    return out


async def statuses(queue: Queue, ids: list[str]) -> list[JobStatus]:
    return [await queue.status(i) for i in ids]
