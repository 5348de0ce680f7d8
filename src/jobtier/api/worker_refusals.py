"""The refusals of the HTTP worker routes: an answer about a job whose lease is not the
worker's any more (409, nothing changed), or a job Redis does not keep (404), saying what the
job is now, so that a worker that sent an answer again, its first reply lost, can tell whether
the first was taken."""

from __future__ import annotations

import orjson

from jobtier.api.problems import Problem
from jobtier.api.worker_bodies import ItemOutcome
from jobtier.core.errors import Code
from jobtier.engine.queue import Queue
from jobtier.status.docs import read_docs


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
    (problem,) = await _refusals_now(queue, [(job_id, code)])
    return problem


def item_refused(job_id: str, code: Code) -> ItemOutcome:
    return _as_item(job_id, refused(job_id, code))


async def items_refused_now(queue: Queue, items: list[tuple[str, Code]]) -> list[ItemOutcome]:
    """``item_refused`` of each, saying what the job is now (``refused_now``), as a batch
    sent again, its first reply lost, has every item refused."""
    problems = await _refusals_now(queue, items)
    return [_as_item(job_id, p) for (job_id, _), p in zip(items, problems, strict=True)]


async def _refusals_now(queue: Queue, items: list[tuple[str, Code]]) -> list[Problem]:
    """``refused`` of each, with what its job is now: their documents read together (a
    script call per shard, pipelined); none for a 404, or a job gone since."""
    ids = [job_id for job_id, code in items if code is not Code.NOT_FOUND]
    docs = dict(zip(ids, await read_docs(queue.redis, queue.keys, ids), strict=True))
    out = []
    for job_id, code in items:
        problem = refused(job_id, code)
        found = docs.get(job_id)
        if problem.status == 409 and found and found[1] is not None:
            doc = orjson.loads(found[1])
            now = {k: doc.get(k) for k in ("state", "attempt", "worker")}
            by = f", worker {now['worker']}" if now["worker"] else ""
            detail = f"{problem.detail}; it is {now['state']} now (attempt {now['attempt']}{by})"
            problem = Problem(409, "conflict", detail, **problem.extra, **now)
        out.append(problem)
    return out


def _as_item(job_id: str, problem: Problem) -> ItemOutcome:
    now = problem.extra
    state, attempt, by = now.get("state"), now.get("attempt"), now.get("worker")
    return ItemOutcome(job_id, problem.status, state, problem.detail, attempt, by)


async def attempt_now(queue: Queue, job_id: str) -> int | None:
    """The job's attempt as Redis has it now (None: gone)."""
    ((_, doc),) = await read_docs(queue.redis, queue.keys, [job_id])
    return None if doc is None else int(orjson.loads(doc)["attempt"])
