"""The checks of a job's options before anything is sent: each raises ``InvalidRequest``
naming the field, and none touches Redis."""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import Keys
from jobtier.core.model import JobSpec
from jobtier.core.names import IDEMPOTENCY_KEY_RE

MAX_ATTEMPTS_LIMIT = 100
MAX_CONCURRENCY_LIMIT = 10_000
KEY_RULE = "1-200 printable ASCII characters without spaces"

# names found valid, as (what, name): a batch repeats a few, and this set is bounded (names
# can be made per request, a tenant per user)
_valid: set[tuple[str, str]] = set()


def check_name(
    what: str, name: Any, pattern: re.Pattern[str], shown: int, field: str | None
) -> None:
    """``InvalidRequest`` unless ``name`` is a str that matches ``pattern``."""
    if isinstance(name, str) and (what, name) in _valid:
        return
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise InvalidRequest(
            f"{what} {str(name)[:shown]!r} must match {pattern.pattern}", field=field
        )
    if len(_valid) >= 4096:
        _valid.clear()
    _valid.add((what, name))


def check_key(key: str | None, field: str) -> str:
    """An idempotency or concurrency key ('' for none)."""
    if key is None:
        return ""
    if not isinstance(key, str) or not IDEMPOTENCY_KEY_RE.fullmatch(key):
        raise InvalidRequest(f"{field} must be {KEY_RULE}", field=field)
    return key


def max_attempts(given: Any) -> int:
    if isinstance(given, bool) or not 1 <= given <= MAX_ATTEMPTS_LIMIT:
        raise InvalidRequest(
            f"max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}", field="max_attempts"
        )
    return int(given)


def concurrency(spec: JobSpec) -> tuple[str, int]:
    """(concurrency key or '', its limit)."""
    limit = spec.concurrency_limit
    if limit is not None and (isinstance(limit, bool) or not 1 <= limit <= MAX_CONCURRENCY_LIMIT):
        raise InvalidRequest(
            f"concurrency_limit must be between 1 and {MAX_CONCURRENCY_LIMIT}",
            field="concurrency_limit",
        )
    if spec.concurrency_key is None:
        # a limit of nothing: the job would run unlimited, as its sender may not expect
        raise InvalidRequest(
            "concurrency_limit limits the jobs of a concurrency_key: give one with it",
            field="concurrency_limit",
        )
    return check_key(spec.concurrency_key, "concurrency_key"), 1 if limit is None else limit


def timing(spec: JobSpec, s: Settings) -> tuple[int, int]:
    """(run-at ms or 0, delay ms or 0)."""
    if spec.run_at is not None and spec.delay is not None:
        raise InvalidRequest("give run_at or delay, not both", field="run_at")
    if spec.delay is not None:
        delay = seconds_of(spec.delay, "delay")
        if delay < 0:
            raise InvalidRequest("delay must be a non-negative number of seconds", field="delay")
        if delay > s.max_future_seconds:
            raise InvalidRequest(
                f"delay is more than {furthest(s.max_future_seconds)}", field="delay"
            )
        return 0, round(delay * 1000)
    if spec.run_at is not None:
        if spec.run_at.tzinfo is None:
            raise InvalidRequest("run_at needs a time zone (e.g. a trailing Z)", field="run_at")
        at = spec.run_at.timestamp()
        now = time.time()
        if at < now - s.past_tolerance_seconds:
            raise InvalidRequest(
                f"run_at is more than {s.past_tolerance_seconds:g} s in the past", field="run_at"
            )
        if at > now + s.max_future_seconds:
            raise InvalidRequest(
                f"run_at is more than {furthest(s.max_future_seconds)} ahead", field="run_at"
            )
        return max(round(at * 1000), 1), 0
    return 0, 0


def seconds_of(value: Any, field: str) -> float:
    """``value`` as seconds: a finite number, or a ``timedelta`` (a JobSpec built in Python
    may hold one); else refused naming ``field``."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{field} must be a number of seconds", field=field)
    return float(value)


def period_ms(value: Any, field: str, s: Settings) -> int:
    """A positive number of seconds within JOBTIER_MAX_FUTURE_SECONDS, as whole ms (≥ 1): a
    job's own timeout, a debounce's or throttle's period (engine/keyed.py)."""
    seconds = seconds_of(value, field)
    if seconds <= 0 or seconds > s.max_future_seconds:
        raise InvalidRequest(
            f"{field} must be more than 0 and at most {furthest(s.max_future_seconds)}",
            field=field,
        )
    return max(1, round(seconds * 1000))


def expiry(spec: JobSpec, s: Settings, run_at_ms: int, delay_ms: int) -> tuple[int, int]:
    """(expires-at ms or 0, expires-in ms or 0): a time after the job is due and after now,
    within JOBTIER_MAX_FUTURE_SECONDS."""
    if spec.expires_at is not None and spec.expires_in is not None:
        raise InvalidRequest("give expires_at or expires_in, not both", field="expires_at")
    now = time.time()
    given = None if spec.expires_in is None else seconds_of(spec.expires_in, "expires_in")
    if given is not None:
        field = "expires_in"
        if given <= 0:
            raise InvalidRequest("expires_in must be a positive number of seconds", field=field)
        at = now + given
    else:
        field, when = "expires_at", spec.expires_at
        assert when is not None
        if when.tzinfo is None:
            raise InvalidRequest("expires_at needs a time zone (e.g. a trailing Z)", field=field)
        at = when.timestamp()
        if at <= now:
            raise InvalidRequest("expires_at is in the past", field=field)
    if at > now + s.max_future_seconds:
        raise InvalidRequest(
            f"{field} is more than {furthest(s.max_future_seconds)} ahead", field=field
        )
    due = run_at_ms / 1000 if run_at_ms else now + delay_ms / 1000
    if (run_at_ms or delay_ms) and at <= due:
        said = "run_at" if run_at_ms else "delay"
        raise InvalidRequest(
            f"{field} is not after the job's {said}: it could never start", field=field
        )
    if given is not None:
        return 0, max(round(given * 1000), 1)
    return max(round(at * 1000), 1), 0


def furthest(seconds: int) -> str:
    """How far ahead a job may be put, as a person reads it, and the setting that says so:
    ``31622400 s (366 days, JOBTIER_MAX_FUTURE_SECONDS)``."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            many = f"{seconds / size:.4g} {unit}{'' if seconds == size else 's'}"
            return f"{seconds} s ({many}, JOBTIER_MAX_FUTURE_SECONDS)"
    return f"{seconds} s (JOBTIER_MAX_FUTURE_SECONDS)"


def depends_on(spec: JobSpec, keys: Keys, limit: int) -> list[str]:
    """The job ids it waits for, each once, in order."""
    if spec.on_dependency_failure not in (None, "cancel", "run"):
        raise InvalidRequest(
            "on_dependency_failure must be cancel or run", field="on_dependency_failure"
        )
    if spec.depends_on is None:
        return []
    if not isinstance(spec.depends_on, list):
        raise InvalidRequest("depends_on must be a list of job ids", field="depends_on")
    deps = list(dict.fromkeys(spec.depends_on))
    for dep in deps:
        if not isinstance(dep, str) or not keys.valid_id(dep):
            raise InvalidRequest(
                f"depends_on names {str(dep)[:70]!r}, which is not a job id", field="depends_on"
            )
    if len(deps) > limit:
        raise InvalidRequest(
            f"a job waits for at most {limit} others (JOBTIER_MAX_FLOW_JOBS)", field="depends_on"
        )
    return deps


def request_hash(spec: JobSpec, payload: bytes, deps: list[str]) -> str:
    """What tells "the same request" apart for an idempotency key (submit.lua compares it):
    the type, the payload, and what it waits for."""
    return request_hash_of(spec.type, payload, deps, spec.on_dependency_failure)


def request_hash_of(
    type: str, payload: bytes, deps: Sequence[str] = (), on_dependency_failure: str | None = None
) -> str:
    """``request_hash`` from its parts (persist/reconcile.py makes it again from Postgres's
    copy of a job, to put back the idempotency record of a job Redis lost)."""
    material = type.encode() + b"\x00" + payload
    if deps:
        odf = on_dependency_failure or "cancel"
        material += f"\x00{' '.join(deps)}\x00{odf}".encode()
    return hashlib.blake2b(material, digest_size=16).hexdigest()
