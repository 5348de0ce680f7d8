"""Checks of a submit's ``debounce``, ``throttle`` and ``unique`` (docs/debounce-throttle.md):
each raises ``InvalidRequest`` naming the field, before anything is sent.

A keyed job lives in its key's shard, so the key's record and the job are one slot and
store/lua/keyed.lua decides and creates (or replaces) in one atomic step. That fixes the
shard, so ``concurrency_key``, which fixes it otherwise, is refused beside it (a throttled
job's ``idempotency_key`` record follows it into the key's shard), as are those that would
fight over the run time (``run_at``, ``delay``: a unique job may have them) and a flow's
dependencies; a debounce, which changes a job, has no idempotency key, nor has a unique job,
whose key already makes a repeat answer its job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from jobtier.config import Settings
from jobtier.core.debounce import Debounce, KeyedOption, Throttle, Unique
from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import Keys
from jobtier.core.model import JobSpec
from jobtier.engine.validate import MAX_CONCURRENCY_LIMIT, check_key, period_ms

# what a keyed submit cannot be given, and why (a throttled one may have an idempotency key:
# its record then lives in the throttle key's shard, so the key is scoped to it)
_EXCLUSIVE = (
    ("concurrency_key", "a keyed job's shard is its key's, not its concurrency key's"),
    ("run_at", "the key decides when the job runs"),
    ("delay", "the key decides when the job runs"),
    ("depends_on", "a job that waits for others cannot be keyed so"),
)


def as_option(value: Any, kind: type[Debounce] | type[Throttle] | type[Unique], field: str) -> Any:
    """A Python caller's ``debounce``, ``throttle`` or ``unique``: the struct, or a mapping of
    it."""
    if value is None or isinstance(value, kind):
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{field} must be an object ({kind.__name__})", field=field)
    try:
        return msgspec.convert(dict(value), kind)
    except msgspec.ValidationError as exc:
        # msgspec names the member: "Expected `float` > 0 - at `$.seconds`"
        _, at, path = str(exc).rpartition(" - at `$")
        where = f"{field}{path.rstrip('`')}" if at else field
        raise InvalidRequest(f"{where}: {exc}", field=where) from None


def option(spec: JobSpec, s: Settings) -> KeyedOption | None:
    """The checked debounce, throttle or unique of ``spec`` (None: none). A ``JobSpec`` made
    in Python may hold a mapping for one (its fields are not checked when it is made)."""
    debounce = as_option(spec.debounce, Debounce, "debounce")
    throttle = as_option(spec.throttle, Throttle, "throttle")
    unique = as_option(spec.unique, Unique, "unique")
    options = (("debounce", debounce), ("throttle", throttle), ("unique", unique))
    given = [name for name, option in options if option is not None]
    if not given:
        return None
    if len(given) > 1:
        both = " and ".join(given)
        raise InvalidRequest(
            f"give only one of debounce, throttle and unique, not {both}", field=given[-1]
        )
    name = given[0]
    if unique is not None:
        return _unique(spec, unique)
    if debounce is not None and spec.idempotency_key is not None:
        raise InvalidRequest(
            "debounce cannot be given with idempotency_key: a debounced submit changes the "
            "pending job of its key, where a repeat must change nothing",
            field=name,
        )
    for field, why in _EXCLUSIVE:  # the refusal names the keyed option, the message both
        if getattr(spec, field) is not None:
            raise InvalidRequest(f"{name} cannot be given with {field}: {why}", field=name)
    if debounce is not None:
        key = check_key(debounce.key, "debounce.key")
        quiet = period_ms(debounce.seconds, "debounce.seconds", s)
        most = 0
        if debounce.max_wait is not None:
            most = period_ms(debounce.max_wait, "debounce.max_wait", s)
            if most < quiet:
                raise InvalidRequest(
                    "debounce.max_wait must be at least debounce.seconds",
                    field="debounce.max_wait",
                )
        return KeyedOption("debounce", key, quiet, most)
    assert throttle is not None
    key = check_key(throttle.key, "throttle.key")
    limit = throttle.limit
    if (
        isinstance(limit, bool)
        or not isinstance(limit, int)
        or not 1 <= limit <= MAX_CONCURRENCY_LIMIT
    ):
        raise InvalidRequest(
            f"throttle.limit must be a whole number from 1 to {MAX_CONCURRENCY_LIMIT}",
            field="throttle.limit",
        )
    period = period_ms(throttle.period, "throttle.period", s)
    if throttle.on_limit not in ("refuse", "delay"):
        raise InvalidRequest(
            "throttle.on_limit must be one of refuse, delay", field="throttle.on_limit"
        )
    furthest = s.max_future_seconds * 1000  # as far as a run_at may be
    return KeyedOption("throttle", key, limit, period, throttle.on_limit, furthest)


def _unique(spec: JobSpec, unique: Unique) -> KeyedOption:
    if spec.idempotency_key is not None:
        raise InvalidRequest(
            "unique cannot be given with idempotency_key: a submit while the key's job has "
            "not finished answers that job already",
            field="unique",
        )
    for field, why in _EXCLUSIVE:
        if field not in ("run_at", "delay") and getattr(spec, field) is not None:
            raise InvalidRequest(f"unique cannot be given with {field}: {why}", field="unique")
    key = check_key(unique.key, "unique.key")
    if unique.until not in ("finished", "started"):
        raise InvalidRequest("unique.until must be one of finished, started", field="unique.until")
    return KeyedOption("unique", key, 1 if unique.until == "finished" else 0, 0)


def shard(keys: Keys, tenant: str, queue: str, type: str, keyed: KeyedOption) -> int:
    """The shard of a keyed job: its key's (per tenant; a debounce key per queue and type)."""
    if keyed.kind == "debounce":
        return keys.shard_for(tenant, "\x02debounce", queue, type, keyed.key)
    if keyed.kind == "unique":
        return keys.shard_for(tenant, "\x02unique", keyed.key)
    return keys.shard_for(tenant, "\x02throttle", keyed.key)


def check_sealed(keyed: KeyedOption | None) -> None:
    """For a job whose payload is sealed: a debounced payload replaces another job's, and a
    sealed payload is bound to its own job's id (core/sealing.py), so the two cannot meet."""
    if keyed is not None and keyed.kind == "debounce":
        raise InvalidRequest(
            "this job's payload is encrypted (docs/encryption.md), which debounce does not "
            "support: a replacing payload would be sealed for another job's id",
            field="debounce",
        )


def alone(keyed: list[KeyedOption | None]) -> None:
    """A keyed job is submitted alone (a batch's jobs, one by one, each with its key)."""
    for index, option in enumerate(keyed):
        if option is not None:
            raise InvalidRequest(
                f"jobs[{index}]: {option.kind} is for a job submitted alone, not in a batch",
                field=f"jobs[{index}].{option.kind}",
            )
