"""keyed.lua's call: one job submitted under a debounce, throttle or unique key
(docs/debounce-throttle.md). A submit with such a key goes alone in its call; the key's
record and the job live in one shard, which the job's id names (engine/keyed.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobtier.core.debounce import KeyedOption, Throttled
from jobtier.core.errors import Code
from jobtier.runtime import tracing
from jobtier.store.calls import Call, SubmitItem, SubmitOutcome
from jobtier.store.scripts import Scripts


def keyed_call(
    shard: int, item: SubmitItem, option: KeyedOption, idem_ttl_ms: int, trace: str = ""
) -> Call:
    payload = item.payload if item.seal is None else item.seal(item.job_id, item.payload)
    args = [
        trace,
        item.job_id,
        item.tenant,
        item.type,
        item.queue,
        item.priority,
        payload,
        item.max_attempts,
        *option.args(),
    ]
    if option.kind == "throttle":
        args += [item.idempotency_key, item.request_hash, idem_ttl_ms]
    elif option.kind == "unique":  # a unique job may have a run-at or a delay
        args += [item.run_at_ms, item.delay_ms]
    args.append(item.flow)  # last: its compensation (lib.lua flow_create)
    return ("keyed", shard, args)


@dataclass(frozen=True, slots=True)
class KeyedOutcome:
    outcome: str  # 'created' | 'replaced' | 'refused' | 'duplicate' | 'conflict' | 'existing'
    job_id: str
    doc: bytes
    ms: int  # created, replaced: when the job runs; refused: ms until a slot is free


def parse_keyed(reply: list[Any]) -> KeyedOutcome:
    outcome, job_id, doc, ms = reply
    return KeyedOutcome(outcome.decode(), job_id.decode(), doc or b"", int(ms))


def as_submit_outcome(option: KeyedOption, got: KeyedOutcome) -> SubmitOutcome:
    """The outcome as a plain submit's: created (OK); the key's pending job, which took this
    payload, a unique key's unfinished job, or an idempotent repeat's job (DUPLICATE: a job
    made by an earlier submit); the
    idempotency key used by another request (IDEMPOTENCY_CONFLICT); ``Throttled`` when
    refused."""
    if got.outcome == "refused":
        period = option.second / 1000
        raise Throttled(option.key, option.first, period, got.ms / 1000)
    code = _CODES[got.outcome]
    return SubmitOutcome(code, got.job_id, got.doc)


_CODES = {
    "created": Code.OK,
    "replaced": Code.DUPLICATE,
    "duplicate": Code.DUPLICATE,
    "existing": Code.DUPLICATE,
    "conflict": Code.IDEMPOTENCY_CONFLICT,
}


async def submit_keyed(
    scripts: Scripts, shard: int, item: SubmitItem, idem_ttl_ms: int
) -> SubmitOutcome:
    """Submit ``item`` (its ``keyed`` set) in ``shard``, its key's; ``Throttled`` when its
    throttle refuses it. The job keeps the submit's traceparent, as a plain submit's."""
    option = item.keyed
    if option is None:
        raise ValueError(f"job {item.job_id} has no debounce or throttle key")
    call = keyed_call(shard, item, option, idem_ttl_ms, tracing.traceparent())
    reply = await scripts.call(*call)
    return as_submit_outcome(option, parse_keyed(reply))
