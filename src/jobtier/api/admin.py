"""Admin routes (admin key): dead letters, replay (audited: audit.py), queue statistics."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.audit import audited
from jobtier.api.auth import require_admin
from jobtier.api.http import JSON, decode_body, encoded, job_id_of, job_not_found, read_json_body
from jobtier.api.params import TYPE, date_time, limit_param, parse_query
from jobtier.api.problems import Problem
from jobtier.core.errors import JobNotFound, TransitionRefused
from jobtier.core.names import QUEUE_NAME_RE, TASK_NAME_RE, TENANT_RE
from jobtier.engine.queue import Queue
from jobtier.status.answer import DocResponse


class ReplayFilter(msgspec.Struct, forbid_unknown_fields=True):
    """Which dead letters to replay: of one type, queue or tenant, dead-lettered since a time
    (each optional), at most ``limit`` of them, newest first."""

    type: str | None = None
    since: datetime | None = None  # dead-lettered at or after (no time zone: UTC)
    limit: int = 100
    queue: str | None = None
    tenant: str | None = None
    all: bool = False  # no filter: every dead letter (up to limit), asked for by name


_filter_decoder = msgspec.json.Decoder(ReplayFilter)
REPLAY_MAX = 10_000
DEAD_LETTER_PARAMS = [
    TYPE,
    date_time("since", "only jobs dead-lettered at or after this time (ISO 8601)"),
    limit_param("most jobs to list (default 100)", 1000),
]


async def dead_letters(request: Request) -> Response:
    require_admin(request)
    query = parse_query(request, DEAD_LETTER_PARAMS)
    queue: Queue = request.state.queue
    jobs = await queue.jobs.dead_letters(
        query.get("limit", 100), type=query.get("type"), since=query.get("since")
    )
    return encoded({"jobs": jobs})


async def replay_one(request: Request) -> Response:
    require_admin(request)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    async with audited(request, "job.replay", job_id):
        try:
            doc = await queue.jobs.replay_doc(job_id)
        except JobNotFound:
            raise job_not_found(job_id) from None
        except TransitionRefused as exc:
            detail = exc.reason or f"job {job_id} is not in the dead-letter set"
            if exc.holder is not None:
                raise Problem(409, "unique-held", detail, holder=exc.holder) from None
            raise Problem(409, "wrong-state", detail) from None
    return DocResponse(doc)


async def replay_many(request: Request) -> Response:
    require_admin(request)
    body = await read_json_body(request)
    selector: ReplayFilter = decode_body(_filter_decoder, body or b"{}")
    if not 1 <= selector.limit <= REPLAY_MAX:
        raise Problem(422, "validation", f"limit must be between 1 and {REPLAY_MAX}", field="limit")
    for field, value, pattern in (
        ("type", selector.type, TASK_NAME_RE),
        ("queue", selector.queue, QUEUE_NAME_RE),
        ("tenant", selector.tenant, TENANT_RE),
    ):
        if value is not None and not pattern.fullmatch(value):
            raise Problem(422, "validation", f"{field} must match {pattern.pattern}", field=field)
    filters = (selector.type, selector.since, selector.queue, selector.tenant)
    if not selector.all and all(f is None for f in filters):
        # a bulk action across every tenant is asked for by name, not reached by leaving the
        # filters out (or the body)
        raise Problem(
            422,
            "validation",
            'give type, queue, tenant and/or since, or "all": true to replay every dead letter '
            f"(up to limit: {selector.limit})",
            field="all",
        )
    queue: Queue = request.state.queue
    since = selector.since
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    what = msgspec.to_builtins(selector)  # the filter as given, for the audit
    shown = ((k, v) for k, v in what.items() if v is not None and k not in ("limit", "all"))
    target = ",".join(f"{k}={v}" for k, v in shown)
    async with audited(request, "dead_letters.replay", target or "all") as outcome:
        given = msgspec.structs.asdict(selector) | {"since": since}  # replay_many's arguments
        del given["all"]
        replayed = await queue.jobs.replay_many(**given)
        skipped = [{"id": j, "holder": h, "why": "unique-held"} for j, h in replayed.held]
        outcome.detail = {"filter": what, "count": len(replayed), "replayed": replayed[:100]}
        if skipped:
            outcome.detail["skipped"] = skipped[:100]
    answer = {"replayed": replayed, "count": len(replayed), "skipped": skipped}
    return Response(orjson.dumps(answer), media_type=JSON)


async def stats(request: Request) -> Response:
    """Queue depths per shard and priority, waiting jobs per tenant, live workers, the
    status tier's counters and the write-behind lag."""
    require_admin(request)
    queue: Queue = request.state.queue
    out = await queue.admin.stats()
    out["waiting_by_tenant"] = await queue.admin.waiting_by_tenant()
    out["workers"] = await queue.admin.live_workers()
    out["status_reads"] = request.state.reader.stats()
    out["write_behind_lag"] = request.state.admission.lag
    return Response(orjson.dumps(out), media_type=JSON)
