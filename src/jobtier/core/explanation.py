"""Why a job has not started: the answer of ``GET /v1/jobs/{id}/explain`` (engine/explain.py
builds it, the client decodes it)."""

from __future__ import annotations

from enum import StrEnum

import msgspec


class ReasonCode(StrEnum):
    """What keeps a job from starting (several may hold at once), or that it is not waiting."""

    NOT_WAITING = "not_waiting"  # running, or finished
    QUEUE_PAUSED = "queue_paused"
    QUEUE_CONCURRENCY_FULL = "queue_concurrency_full"  # the queue's global concurrency limit
    RATE_LIMITED = "rate_limited"  # the queue's rate limit, or a task raised RateLimited
    BREAKER_OPEN = "breaker_open"  # the circuit breaker of its downstream held it back
    CONCURRENCY_KEY_HELD = "concurrency_key_held"
    WAITING_FOR_DEPENDENCIES = "waiting_for_dependencies"
    SCHEDULED = "scheduled"
    NO_WORKER_FOR_QUEUE = "no_worker_for_queue"
    NO_WORKER_FOR_TYPE = "no_worker_for_type"
    TENANT_TURN = "tenant_turn"  # other tenants' jobs come first by the tenants' turns
    IN_LINE = "in_line"  # ready: jobs ahead of it, its workers busy or about to claim it
    NOT_RELAYED = "not_relayed"  # submitted with SQL: the outbox relay has not taken it yet
    EXPIRED = "expired"  # past its expiry, or due after it: a claim cancels it, never runs it
    UNKNOWN = "unknown"  # queued, yet Redis holds it in no line (a broken invariant); or
    # not finished in Postgres and absent from Redis, which lost it

    @classmethod
    def _missing_(cls, value: object) -> ReasonCode | None:
        """A code this jobtier does not know, as a newer server may send (each new reason is
        one): kept as it came, so that a client older than its server reads the explanation,
        the code's ``message`` with it, instead of failing to decode it."""
        if not isinstance(value, str):
            return None
        code = str.__new__(cls, value)
        code._name_ = value.upper()
        code._value_ = value
        return code


class JobRef(msgspec.Struct):
    """Another job, and its state now (``null``: Redis no longer holds it)."""

    id: str
    state: str | None


class Reason(msgspec.Struct, omit_defaults=True):
    """One reason, in words (``message``) and in numbers: the members of its code only."""

    code: ReasonCode
    message: str
    queue: str | None = None
    type: str | None = None
    key: str | None = None  # concurrency_key_held: the key
    breaker: str | None = None  # breaker_open: the breaker's name (its state: ``message``)
    running: int | None = None  # concurrency: running now (or ready under the key)
    limit: int | None = None  # concurrency: the most at once
    holders: list[JobRef] | None = None  # concurrency_key_held: the jobs found holding it
    until: str | None = None  # rate_limited, scheduled: when it ends; expired: the expiry
    seconds: float | None = None  # ... and how long that is from now (negative: past due)
    rate: int | None = None  # rate_limited by the queue's rate: starts per period
    per: float | None = None  # ... the period, seconds
    started: int | None = None  # ... starts in the last period
    dependencies: list[JobRef] | None = None  # waiting: the pending ones (the first listed)
    pending: int | None = None
    total: int | None = None
    failed: int | None = None
    ahead: int | None = None  # jobs that go before it (in its line, or behind the key)
    # in_line, tenant_turn, concurrency_key_held: ``ahead`` is a lower bound (true), the job
    # is deeper in its line than the explain script reads
    at_least: bool | None = None
    tenants: int | None = None  # tenant_turn: tenants with ready jobs at its priority
    workers: int | None = None  # live workers that could run it (no_worker: that serve others)
    busy: int | None = None  # in_line: of those, how many have no free slot
    slots: int | None = None  # in_line: their slots
    in_use: int | None = None  # in_line: of which in use (as of their last heartbeat)


class Explanation(msgspec.Struct):
    """Why ``id`` has not started: ``waiting`` is false for a job running or finished (one
    ``not_waiting`` reason says which). ``position``: its place in line in its queue on its
    shard, counted as the claim script takes jobs (1: next), for a job in a ready line or
    handed back; null otherwise, and null too when it is deeper in its line than the script
    reads (its reasons' ``at_least``). ``checked_at``: Redis's clock when it was read."""

    id: str
    state: str
    waiting: bool
    reasons: list[Reason]
    position: int | None
    checked_at: str


explanation_decoder = msgspec.json.Decoder(Explanation)
