"""Numeric settings out of their bounds are refused at start-up, naming the variable."""

from __future__ import annotations

import dataclasses
import re

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
    ],
)
def test_values_that_break_a_deployment_are_refused(changes: dict[str, object], says: str) -> None:
    assert says in refused(**changes)


HELP = {f.name: str(f.metadata.get("help", "")) for f in dataclasses.fields(Settings)}
# a setting whose help gives 0 a meaning ("0: never", "(0: unlimited)", "0 (off)")
ZERO_MEANS = [n for n in NUMERIC if re.search(r"\b0(:| \()", HELP[n])]


@pytest.mark.parametrize("name", ZERO_MEANS)
def test_a_zero_its_help_gives_a_meaning_is_taken(name: str) -> None:
    Settings().replace(**{name: type(getattr(Settings(), name))(0)})


def test_the_defaults_and_other_zeros_pass() -> None:
    assert "reconcile_seconds" in ZERO_MEANS and "rate_limit_per_second" in ZERO_MEANS
    Settings().validate()
    Settings().replace(
        idempotency_ttl_seconds=0,  # keys not kept (tests/integration/test_outbox.py)
        persist_hold_seconds=15,  # half of the default claim idle
        redis_memory_refuse_ratio=0.001,  # below the warning's: allowed (it never warns first)
    )
