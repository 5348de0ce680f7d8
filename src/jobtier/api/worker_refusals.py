"""The refusals of the HTTP worker routes: an answer about a job whose lease is not the
worker's any more (409, nothing changed), or a job Redis does not keep (404), saying what the
job is now, so that a worker that sent an answer again, its first reply lost, can tell whether
the first was taken."""

from __future__ import annotations

import orjson

from jobtier.api.problems import Problem
from jobtier.api.worker_bodies import ItemOutcome
from jobtier.core.errors import Code, JobNotFound
from jobtier.engine.queue import Queue


def refused(job_id: str, code: Code) -> Problem:
    """A stale answer: the job's lease is not this worker's any more (nothing changed)."""
    if code is Code.NOT_FOUND:
        return Problem(404, "not-found", f"job {job_id} is not kept in Redis")
    why = {
        Code.VERSION_CONFLICT: "its lease_version is not this one (the job was claimed again "
        "since, or this lease_version was never given)",
        Code.WRONG_STATE: "the job is no longer running",
        Code.NOT_OWNER: "another worker holds the job",
    }.get(code, code.name)
    return Problem(409, "conflict", f"lease lost on job {job_id}: {why}", job_id=job_id)


async def refused_now(queue: Queue, job_id: str, code: Code) -> Problem:
    """``refused``, saying what the job is now: its ``state``, ``attempt`` and ``worker``,
    in the detail and as members. A worker that sent an answer again, its first reply lost,
    learns from them whether the first was taken (its own worker id and attempt, the state
    its answer makes)."""
    problem = refused(job_id, code)
    if code is Code.NOT_FOUND:
        return problem
    try:
        doc = orjson.loads(await queue.jobs.status_doc(job_id))
    except JobNotFound:  # gone since
        return problem
    now = {k: doc.get(k) for k in ("state", "attempt", "worker")}
    by = f", worker {now['worker']}" if now["worker"] else ""
    detail = f"{problem.detail}; it is {now['state']} now (attempt {now['attempt']}{by})"
    return Problem(409, "conflict", detail, job_id=job_id, **now)


def item_refused(job_id: str, code: Code) -> ItemOutcome:
    problem = refused(job_id, code)
    return ItemOutcome(job_id, problem.status, None, problem.detail)


async def item_refused_now(queue: Queue, job_id: str, code: Code) -> ItemOutcome:
    """``item_refused``, saying what the job is now (``refused_now``): refusals are few."""
    problem = await refused_now(queue, job_id, code)
    now = problem.extra
    return ItemOutcome(
        job_id, problem.status, now.get("state"), problem.detail, now.get("attempt"),
        now.get("worker"),
    )  # fmt: skip
