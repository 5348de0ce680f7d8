"""``explain``: why a job has not started (``GET /v1/jobs/{id}/explain``), an operation of
both clients (``_core`` holds the rest)."""

from __future__ import annotations

from jobtier.client._core import Call, Op, fetch, job_path
from jobtier.core.explanation import Explanation, explanation_decoder


def explain_op(job_id: str) -> Op[Explanation]:
    call = Call("GET", job_path(job_id, "/explain"))
    return (yield from fetch(call, explanation_decoder, "an explanation", job_id))
