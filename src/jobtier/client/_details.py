"""A job's result, history, log lines, and all of them with its status (``show``):
operations of both clients (``_core`` holds the rest)."""

from __future__ import annotations

from typing import Any

import msgspec

from jobtier.client._core import Call, Op, fetch, job_path
from jobtier.client._errors import ApiError
from jobtier.client._types import (
    JobDetails,
    Result,
    history_decoder,
    logs_decoder,
    result_decoder,
)
from jobtier.core.model import LogLine, Transition, any_decoder, status_decoder

# what the API answers for what only Postgres holds when it has none (404), or its Postgres
# is away (503): ``show`` gives the rest
AWAY = (404, 503)
# why ``show`` gives no result, by the answer of a result kept in the result store
MISSING = {
    (503, "unavailable"): "kept in the result store, which is away",
    (410, "gone"): "no longer kept in the result store",
}


def result_op(job_id: str) -> Op[Result]:
    found = yield from _result_document(job_id)
    if found.result_url is None:
        return found
    value = yield from _stored_result(found.result_url, job_id)
    return msgspec.structs.replace(found, result=value)


def history_op(job_id: str) -> Op[list[Transition]]:
    call = Call("GET", job_path(job_id, "/history"))
    return (yield from fetch(call, history_decoder, "a history", job_id)).transitions


def logs_op(job_id: str) -> Op[list[LogLine]]:
    call = Call("GET", job_path(job_id, "/logs"))
    return (yield from fetch(call, logs_decoder, "log lines", job_id)).lines


def show_op(job_id: str) -> Op[JobDetails]:
    """The status, result, history and log lines. What the API cannot read without its
    Postgres (the history; a result kept in the result store, when that is Postgres) is
    None and said so (``history``, ``result_missing``), not a failure of the whole."""
    call = Call("GET", job_path(job_id))
    status = yield from fetch(call, status_decoder, "a status document", job_id)
    found = yield from _result_document(job_id)
    value, missing = found.result, None
    if found.result_url is not None:
        try:
            value = yield from _stored_result(found.result_url, job_id)
        except ApiError as exc:
            # the store away (Postgres, for JOBTIER_RESULT_STORE=postgres), or the result no
            # longer kept; any other answer (an encrypted result this API has no key for) is
            # raised as it is, for what it says
            missing = MISSING.get((exc.status, exc.slug))
            if missing is None:
                raise
            value = None
    try:
        history: list[Transition] | None = yield from history_op(job_id)
    except ApiError as exc:
        if exc.status not in AWAY:
            raise
        history = None
    lines = yield from logs_op(job_id)
    return JobDetails(status, value, history, lines, missing)


def _result_document(job_id: str) -> Op[Result]:
    call = Call("GET", job_path(job_id, "/result"))
    return (yield from fetch(call, result_decoder, "a result document", job_id))


def _stored_result(url: str, job_id: str) -> Op[Any]:
    """A large result, kept outside Redis: streamed from where its document points."""
    return (yield from fetch(Call("GET", url), any_decoder, "a JSON result", job_id))
