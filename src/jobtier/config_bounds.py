"""The bounds of the numeric settings: a value past one is refused where every bad setting is
(``Settings.validate``: ``jobtier config`` and every process's start, exit 2, naming it).

No numeric setting means anything below 0: where 0 has a meaning, its help says it (``0:
unlimited``, ``0: never``), and it is allowed (tests/unit/test_config_bounds.py holds every
such help to it). The ones below need more: a count of 0 or a
time of 0 would refuse every submit (``JOBTIER_PERSIST_MAX_LAG``), forget every finished job
at once (``JOBTIER_RETENTION_SECONDS``) or write nothing (``JOBTIER_PERSIST_BATCH_SIZE``).
Settings whose bounds are more particular are checked in ``config.py`` itself
(``CHECKED_THERE``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

AT_LEAST_ONE = frozenset({
    "max_batch", "max_payload_bytes", "max_result_bytes", "max_request_bytes",
    "max_future_seconds", "min_schedule_interval", "max_waiting_total", "persist_batch_size",
    "persist_concurrency", "persist_max_lag", "outbox_batch_size", "reconcile_window_seconds",
    "retention_seconds", "dead_retention_seconds",
})  # fmt: skip
MORE_THAN_ZERO = frozenset({
    "redis_socket_timeout", "task_catalog_ttl", "sse_heartbeat_seconds",
    "persist_claim_idle_seconds", "outbox_poll_seconds",
})  # fmt: skip
CHECKED_THERE = frozenset({
    "shards", "lease_seconds", "submit_replicas", "submit_replicas_timeout_ms",
    "default_max_attempts", "api_port", "api_workers", "redis_max_connections",
    "checkpoint_max_bytes", "shed_waiting_total", "redis_memory_warn_ratio",
    "redis_memory_refuse_ratio", "max_flow_jobs", "flow_link_timeout_seconds",
    "resolver_claim_idle_seconds", "prune_interval_seconds", "webhook_timeout_seconds",
    "webhook_concurrency", "webhook_unmark_interval_seconds", "progress_history_seconds",
    "pg_history_retention_days", "pg_job_retention_days",
})  # fmt: skip


def bound_problems(settings: Any) -> list[str]:
    """One line per numeric setting of ``settings`` (a ``Settings``, which imports this)
    out of its bounds, and for a hold the persister could not keep."""
    out = []
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if field.name in CHECKED_THERE or isinstance(value, bool):
            continue
        if not isinstance(value, int | float):
            continue
        name = f"JOBTIER_{field.name.upper()}"
        if field.name in AT_LEAST_ONE and value < 1:
            out.append(f"{name} must be at least 1")
        elif field.name in MORE_THAN_ZERO and value <= 0:
            out.append(f"{name} must be more than 0")
        elif value < 0:
            out.append(f"{name} must be 0 or more")
    idle = settings.persist_claim_idle_seconds
    if settings.persist_hold_seconds > idle / 2:
        # a held row's entries stay pending: past that, another persister takes them over
        out.append(
            f"JOBTIER_PERSIST_HOLD_SECONDS must be at most half of "
            f"JOBTIER_PERSIST_CLAIM_IDLE_SECONDS ({idle / 2:g} s)"
        )
    return out
