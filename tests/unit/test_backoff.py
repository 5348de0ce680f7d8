"""The one back-off mechanism every retry loop uses."""

from __future__ import annotations

import random

import pytest

from jobtier.runtime.backoff import BackoffPolicy


def test_grows_by_the_factor_up_to_the_cap_and_resets() -> None:
    b = BackoffPolicy(first=0.1, cap=0.5, factor=2.0, jitter=0.0).start()
    assert [round(b.next(), 3) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert b.failures == 5
    b.reset()
    assert b.failures == 0
    assert b.next() == 0.1


def test_jitter_adds_at_most_its_share() -> None:
    policy = BackoffPolicy(first=1.0, cap=1.0, jitter=0.25)
    rng = random.Random(7)
    waits = [policy.start().next(rng) for _ in range(200)]
    assert all(1.0 <= w <= 1.25 for w in waits)
    assert max(waits) - min(waits) > 0.1  # it does spread


def test_delay_shows_the_next_wait_before_jitter() -> None:
    b = BackoffPolicy(first=0.05, cap=5.0).start()
    assert b.delay == 0.05
    b.next()
    assert b.delay == 0.1


@pytest.mark.parametrize(
    "kwargs",
    [{"first": 0, "cap": 1}, {"first": 2, "cap": 1}, {"first": 1, "cap": 2, "factor": 0.5}],
)
def test_bad_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BackoffPolicy(**kwargs)
