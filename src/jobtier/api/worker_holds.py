"""An HTTP worker's failed or held attempt: what its fail body may ask, and the queue a held
attempt holds back.

A worker that was told to slow down (a partner's 429) gives the attempt back (``held``) and
may hold the job's whole queue back for as long (``block_queue``): no worker, Python or
HTTP, starts a job of it meanwhile — what a Python task's ``RateLimited`` does
(worker/reporter.py). As there, the block is applied whatever became of the attempt, as
long as the job was this worker's: the partner's answer stands though the lease was lost,
and a fail sent again after its answer was lost (refused then: the first went through)
still blocks; a fail about a job another worker holds, or never held, blocks nothing.
"""

from __future__ import annotations

import logging

import orjson

from jobtier.api.problems import Problem
from jobtier.api.worker_bodies import FailRequest
from jobtier.core.errors import JobNotFound
from jobtier.core.names import HTTP_WORKER_PREFIX
from jobtier.engine.queue import Queue
from jobtier.engine.validate import furthest
from jobtier.runtime.loop import FAULTS

log = logging.getLogger("jobtier.api.worker")


def check_fail(body: FailRequest, max_future_seconds: int) -> None:
    """A 422 problem naming the field, for a fail body that asks what cannot be done."""
    if body.retry_in is not None and body.retry_in > max_future_seconds:
        detail = f"retry_in is over {furthest(max_future_seconds)}"
        raise Problem(422, "validation", detail, field="retry_in")
    if body.held and not body.retryable:
        detail = "a held attempt is always retried: held needs retryable (true by default)"
        raise Problem(422, "validation", detail, field="held")
    if body.block_queue and not body.held:
        detail = "block_queue holds the queue back for a held attempt: it needs held"
        raise Problem(422, "validation", detail, field="block_queue")
    if body.block_queue and body.retry_in is None:
        detail = "block_queue needs retry_in: the seconds the queue waits"
        raise Problem(422, "validation", detail, field="block_queue")


def held_by(refusal: Problem | None, worker: str) -> bool:
    """Whether the job of a fail was ``worker``'s: its fail was taken (no ``refusal``), or
    the job was last held by it (the refusal's ``worker``, as ``refused_now`` reads it)."""
    return refusal is None or refusal.extra.get("worker") == HTTP_WORKER_PREFIX + worker


async def hold_queue(queue: Queue, job_id: str, seconds: float, worker: str) -> None:
    """The queue of ``job_id`` starts no job for ``seconds``, on every shard; a limited
    queue's permits wait too (limit.lua), as after a Python task's ``RateLimited``. The
    attempt is given back already (or was): whatever fails here is logged, not answered,
    and the job still waits its ``retry_in`` (the block is what the worker asked on top)."""
    try:
        name = orjson.loads(await queue.jobs.status_doc(job_id))["queue"]
        until = await queue.admin.block(name, seconds)  # a limited queue's permits too
    except JobNotFound:
        return  # not kept in Redis (a purge; a wrong id): no queue to hold back
    except Exception as exc:  # a fault (FAULTS) or anything else: the fail's answer goes out
        level = logging.WARNING if isinstance(exc, FAULTS) else logging.ERROR
        log.log(level, "event=queue_block_failed job=%s worker=%s error=%r", job_id, worker, exc)
        return
    log.info(
        "event=queue_rate_limited job=%s queue=%s worker=%s retry_in_ms=%d until_ms=%d",
        job_id,
        name,
        worker,
        round(seconds * 1000),
        until,
    )
