"""Circuit breakers without Redis: the thresholds' checks, what a worker records for each way
an attempt ends, and how the admin list reads a breaker's hash."""

from __future__ import annotations

from typing import Any

import pytest

from jobtier.core.breaker import Breaker, BreakerOpen, DownstreamDown
from jobtier.core.errors import ConfigError
from jobtier.store.breaker_state import view
from jobtier.worker.attempt import INTERRUPTED, Failure
from jobtier.worker.breaker_gate import outcome_of
from jobtier.worker.registry import task


class Partner502(Exception):
    pass


@pytest.mark.parametrize(
    "options",
    [
        {"failures": 0},
        {"probes": 0},
        {"window": 0},
        {"open_for": 10, "max_open": 5},
        {"backoff": 0.5},
        {"ratio": 0},
        {"ratio": 1.5},
    ],
)
def test_thresholds_that_make_no_sense_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="breaker 'b'"):
        Breaker("b", **options)


def test_a_name_must_fit_in_a_key() -> None:
    with pytest.raises(ConfigError, match="name must match"):
        Breaker("a:b")
    assert Breaker("payments.v2-eu").args()[0] == 5  # the defaults, as breaker.lua reads them
    assert Breaker("p", ratio=0.5, window=1.5).args()[1:3] == (1500, "0.5")


def test_the_task_decorator_takes_a_name_or_a_breaker() -> None:
    async def fn(ctx: Any, payload: Any) -> None: ...

    named = task(breaker="payments")(fn)
    assert named.breaker == Breaker("payments") and named.breaker_on == ()
    with pytest.raises(ConfigError, match="breaker_on without a breaker"):
        task(breaker_on=(Partner502,))(fn)
    with pytest.raises(ConfigError, match="breaker_on holds"):
        task(breaker="p", breaker_on=("Partner502",))(fn)  # type: ignore[arg-type]


async def _fn(ctx: Any, payload: Any) -> None: ...


GUARDED = task(name="guarded", breaker="p", breaker_on=(Partner502,))(_fn)
RATIO = task(name="ratio", breaker=Breaker("r", ratio=0.5))(_fn)


def _failure(exc: Exception) -> Failure:
    return Failure(exc, type(exc).__name__, str(exc), True)


def test_what_a_worker_records_for_each_end() -> None:
    down, partner = _failure(DownstreamDown("refused")), _failure(Partner502("502"))
    own = _failure(ValueError("bad payload"))
    assert outcome_of(GUARDED, down, "") == "f"
    assert outcome_of(GUARDED, partner, "") == "f"  # breaker_on
    assert outcome_of(GUARDED, own, "") is None  # not the downstream's: nothing recorded
    assert outcome_of(GUARDED, own, "w|7") == "n"  # ...but a probe is given back
    assert outcome_of(GUARDED, INTERRUPTED, "w|7") == "n"
    assert outcome_of(GUARDED, b"", "") is None  # a success counts only as a probe...
    assert outcome_of(GUARDED, b"", "w|7") == "s"
    assert outcome_of(RATIO, b"{}", "") == "s"  # ...or towards a ratio


def test_the_hold_names_its_breaker_for_the_explain_answer() -> None:
    held = BreakerOpen("payments", "open", 4.25)
    assert str(held).startswith("breaker=payments is open") and held.retry_after == 4.25


def test_the_admin_list_reads_an_open_breaker_past_its_period_as_half_open() -> None:
    fields = {b"state": b"open", b"until": b"10000", b"trips": b"2", b"reason": b"timeout"}
    fields[b"conf"] = b"5 30000  10 5000 2.0 300000 1"
    before, after = view("p", fields, now=9.0), view("p", fields, now=11.0)
    assert (before.state, before.open_until, before.value) == ("open", 10.0, 1)
    assert (after.state, after.open_until, after.value) == ("half_open", None, 2)
    assert before.thresholds == {
        "failures": 5, "window_ms": 30000, "ratio": None, "min_calls": 10, "open_ms": 5000,
        "backoff": 2.0, "max_open_ms": 300000, "probes": 1,
    }  # fmt: skip
    manual = view("p", {b"state": b"open", b"until": b"0", b"manual": b"1"}, now=11.0)
    assert (manual.state, manual.manual, manual.open_until) == ("open", True, None)
    assert view("new", {}).state == "closed"
