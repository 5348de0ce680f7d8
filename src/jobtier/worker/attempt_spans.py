"""A worker's attempt as an OpenTelemetry span, when tracing is on (runtime/tracing.py).

The span is a child of the context its job was submitted in (the ``traceparent`` the job
keeps), else the first of a trace of its own. It is current while the task runs — in a sync
task's thread too (``TaskThreads``) — so the task's own spans are its children. It ends as
the attempt does, with the outcome: ``succeeded``; ``retry`` or ``failed`` (the exception as
its event, error status); ``held`` (given back uncounted, not failed: the task raised
``RateLimited``, or an open circuit breaker held the job; ``jobtier.held.by`` names which, and
the status is not an error, as ``jobtier_jobs_held_total`` does not count it as a failure);
``cancelled``; ``interrupted`` (a cancel request or a shutdown
stopped an async task); ``released`` (given back at shutdown); ``lost`` (the lease was).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobtier.core.model import ClaimedJob
from jobtier.runtime import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from jobtier.worker.attempt import Failure


def start(tracer: Tracer, job: ClaimedJob) -> Span:
    return tracer.start_span(
        f"attempt {job.type}",
        context=tracing.context_of(job.trace),
        kind=tracing.consumer(),
        # few attributes: the SDK checks each one, a large share of a span's cost
        attributes={
            "jobtier.job.id": job.id,
            "jobtier.job.type": job.type,
            "jobtier.queue": job.queue,
            "jobtier.job.attempt": job.attempt,
        },
    )


def end(span: Span, outcome: str, failure: Failure | None = None) -> None:
    span.set_attribute("jobtier.outcome", outcome)
    if outcome == "held" and failure is not None:
        span.set_attribute("jobtier.held.by", failure.type)
    elif failure is not None:
        span.set_attribute("jobtier.error.type", failure.type)
        # a refused result raised nothing: no exception event, the error status all the same
        exc = failure.exc if failure.raised else None
        tracing.failed(span, exc, f"{failure.type}: {failure.message[:200]}")
    span.end()
