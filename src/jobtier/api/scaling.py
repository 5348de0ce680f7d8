"""How many workers a queue's pool wants: ``GET /v1/admin/queues/{name}/scaling`` (admin key),
the number an autoscaler (KEDA's metrics-api scaler) sets a worker Deployment's replicas to.

The formula (docs/kubernetes.md says why each part is there)::

    ready   = the queue's ready jobs; 0 while it is paused or blocked (a task raised
              RateLimited)                                                    "blocked"
    with a rate limit: ready = min(ready, ceil(rate / per * target_age))     "rate"
    demand  = ready + running, at most the queue's concurrency limit
    desired = ceil(demand / slots)                                          "demand"
    if the oldest ready job waited over target_age (not paused, not blocked, the concurrency
    limit not reached, the rate's allowance not what capped the ready jobs):
        desired = max(desired, live + 1, ceil(live * min(age / target_age, 2)))   "age"
    desired = max(min, desired), then min(max, desired)                      "min", "max"

``slots`` is ``?slots=``, or else the fewest a live worker serving the queue runs at once, or
else (the pool is at zero and the caller named none) a worker's default concurrency.
"""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.auth import require_admin
from jobtier.api.http import encoded
from jobtier.api.params import Param, parse_query
from jobtier.api.problems import Problem
from jobtier.api.queues import queue_name, queue_states
from jobtier.core.model import WORKER_CONCURRENCY, QueueScaling
from jobtier.engine.queue import Queue

TARGET_AGE = 60.0  # seconds the oldest ready job may wait before the age raise applies
# the age raise at most doubles the live workers per read: the autoscaler reads again soon,
# and a queue that is merely slow to claim should not jump to the maximum at once
AGE_STEP = 2.0
MOST_WORKERS = 100_000

SCALING_PARAMS = [
    Param(
        "slots",
        "integer",
        "jobs one worker runs at once (its --concurrency); default: the fewest a live worker "
        f"serving the queue runs, or {WORKER_CONCURRENCY} (a worker's default) without one",
        minimum=1,
        maximum=MOST_WORKERS,
    ),
    Param(
        "min", "integer", "fewest workers to ask for (default 0)", minimum=0, maximum=MOST_WORKERS
    ),
    Param(
        "max",
        "integer",
        "most workers to ask for (default: no bound)",
        minimum=1,
        maximum=MOST_WORKERS,
    ),
    Param(
        "target_age",
        "number",
        f"seconds the oldest ready job may wait before workers are added beyond the demand, "
        f"and the time over which a rate limit's starts count (default {TARGET_AGE:g})",
        minimum=0.1,
        maximum=86_400,
    ),
]


def desired_workers(
    *,
    ready: int,
    running: int,
    paused: bool,
    blocked: bool,
    limit: int | None,
    rate_per_second: float | None,
    oldest_age: float | None,
    live: int,
    slots: int,
    target_age: float,
    minimum: int,
    maximum: int | None,
) -> tuple[int, str, int]:
    """The formula of the module's docstring: (desired workers, the clause that set it,
    demand)."""
    # paused or blocked, the ready jobs cannot be claimed: only the running ones need workers
    wanted = 0 if paused or blocked else ready
    decided_by = "blocked" if blocked and not paused else "demand"
    rate_held = False
    if rate_per_second is not None and wanted:
        # slots for more ready jobs than the rate lets start within target_age would idle at
        # least that long; the running jobs keep theirs
        allowance = math.ceil(rate_per_second * target_age)
        if wanted > allowance and (limit is None or running + allowance < limit):
            wanted, decided_by, rate_held = allowance, "rate", True
    demand = wanted + running if limit is None else min(wanted + running, limit)
    desired = math.ceil(demand / slots)
    limit_reached = limit is not None and running >= limit
    held = paused or blocked or limit_reached or rate_held
    if oldest_age is not None and oldest_age > target_age and not held:
        pressure = min(oldest_age / target_age, AGE_STEP)
        raised = max(live + 1, math.ceil(live * pressure))
        if raised > desired:
            desired, decided_by = raised, "age"
    if desired < minimum:
        desired, decided_by = minimum, "min"
    if maximum is not None and desired > maximum:
        desired, decided_by = maximum, "max"
    return desired, decided_by, demand


async def scaling(request: Request) -> Response:
    require_admin(request)
    name = queue_name(request)
    query = parse_query(request, SCALING_PARAMS)
    low, high = query.get("min", 0), query.get("max")
    if high is not None and low > high:
        raise Problem(422, "validation", f"min ({low}) is above max ({high})", field="min")
    queue: Queue = request.state.queue
    workers = await queue.admin.live_workers()
    states = await queue_states(queue, request.state.catalog, workers=workers)
    state: dict[str, Any] | None = next((s for s in states if s["name"] == name), None)
    if state is None:
        detail = f"no queue {name}: no job, limit or task has named it"
        raise Problem(404, "not-found", detail, field="name")
    serving = [w for w in workers if name in w.get("queues", ())]
    slots: int | None = query.get("slots")
    slots_from = "query"
    if slots is None:
        sizes = [int(w.get("concurrency", 0)) for w in serving]
        # the fewest: a pool in the middle of a change of --concurrency is not under-counted
        slots = min((s for s in sizes if s > 0), default=None)
        slots_from = "workers"
    if slots is None:
        # no worker has told its slots: a backlog still asks for the workers it needs, as
        # many as default workers would be
        slots, slots_from = WORKER_CONCURRENCY, "default"
    limits = state["limits"] or {}
    rate = limits.get("rate")
    rate_per_second = None if rate is None else rate / float(limits.get("per", 1.0))
    oldest = state["oldest_queued_age_seconds"]
    target_age = float(query.get("target_age", TARGET_AGE))
    blocked_until = state["blocked_until"]
    desired, decided_by, demand = desired_workers(
        ready=state["queued_total"],
        running=state["running"],
        paused=state["paused"],
        blocked=blocked_until is not None,
        limit=limits.get("concurrency"),
        rate_per_second=rate_per_second,
        oldest_age=oldest,
        live=len(serving),
        slots=slots,
        target_age=target_age,
        minimum=low,
        maximum=high,
    )
    capacity = len(serving) * slots
    answer = QueueScaling(
        queue=name,
        desired_workers=desired,
        decided_by=decided_by,
        ready=state["queued_total"],
        running=state["running"],
        parked=state["parked"],
        paused=state["paused"],
        concurrency_limit=limits.get("concurrency"),
        demand=demand,
        oldest_age_seconds=None if oldest is None else round(oldest, 3),
        live_workers=len(serving),
        slots=slots,
        slots_from=slots_from,
        utilisation=round(state["running"] / capacity, 4) if capacity else None,
        target_age_seconds=target_age,
        min=low,
        max=high,
        rate_per_second=rate_per_second,
        rate_allowance=None if rate_per_second is None else math.ceil(rate_per_second * target_age),
        blocked_until=blocked_until,
    )
    return encoded(answer)
