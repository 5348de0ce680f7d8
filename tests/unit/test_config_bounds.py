"""Numeric settings out of their bounds are refused at start-up, naming the variable."""

from __future__ import annotations

import dataclasses

import pytest

from jobtier import config_bounds
from jobtier.config import Settings
from jobtier.core.errors import ConfigError

NUMERIC = [
    f.name
    for f in dataclasses.fields(Settings)
    if isinstance(getattr(Settings(), f.name), int | float)
    and not isinstance(getattr(Settings(), f.name), bool)
]


def refused(**changes: object) -> str:
    with pytest.raises(ConfigError) as caught:
        Settings().replace(**changes)
    return str(caught.value)


def test_the_bounds_name_real_settings() -> None:
    named = config_bounds.AT_LEAST_ONE | config_bounds.MORE_THAN_ZERO | config_bounds.CHECKED_THERE
    assert named <= set(NUMERIC), named - set(NUMERIC)
    assert not config_bounds.AT_LEAST_ONE & config_bounds.MORE_THAN_ZERO


@pytest.mark.parametrize("name", NUMERIC)
def test_no_numeric_setting_takes_a_negative_value(name: str) -> None:
    kind = type(getattr(Settings(), name))
    says = refused(**{name: kind(-1)})
    assert f"JOBTIER_{name.upper()}" in says, says


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        # each of these started a deployment that refused every submit or lost its jobs
        ({"persist_max_lag": 0}, "JOBTIER_PERSIST_MAX_LAG must be at least 1"),
        ({"retention_seconds": 0}, "JOBTIER_RETENTION_SECONDS must be at least 1"),
        ({"dead_retention_seconds": 0}, "JOBTIER_DEAD_RETENTION_SECONDS must be at least 1"),
        ({"persist_concurrency": 0}, "JOBTIER_PERSIST_CONCURRENCY must be at least 1"),
        ({"persist_batch_size": 0}, "JOBTIER_PERSIST_BATCH_SIZE must be at least 1"),
        ({"max_waiting_total": 0}, "JOBTIER_MAX_WAITING_TOTAL must be at least 1"),
        ({"persist_claim_idle_seconds": 0}, "JOBTIER_PERSIST_CLAIM_IDLE_SECONDS must be more"),
        ({"idempotency_ttl_seconds": -1}, "JOBTIER_IDEMPOTENCY_TTL_SECONDS must be 0 or more"),
        # the persister took it to 15 without a word
        (
            {"persist_hold_seconds": 100},
            "at most half of JOBTIER_PERSIST_CLAIM_IDLE_SECONDS (15 s)",
        ),
        ({"redis_memory_warn_ratio": 0.95}, "JOBTIER_REDIS_MEMORY_WARN_RATIO must be at most"),
    ],
)
def test_values_that_break_a_deployment_are_refused(changes: dict[str, object], says: str) -> None:
    assert says in refused(**changes)


def test_zero_where_it_means_something_and_the_defaults_pass() -> None:
    Settings().validate()
    Settings().replace(
        idempotency_ttl_seconds=0,  # keys not kept (tests/integration/test_outbox.py)
        rate_limit_per_second=0,  # unlimited
        max_waiting_per_tenant=0,  # unlimited
        persist_hold_seconds=15,  # half of the default claim idle
    )
