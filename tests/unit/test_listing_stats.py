"""ListingStats: rows estimated per value from pg_stats's figures, as the planner estimates them,
and the way a listing of queued or running jobs of a type reads by them."""

from __future__ import annotations

import time
from typing import cast

import pytest

from jobtier.persist.db import Pool
from jobtier.persist.listing_stats import ColumnStats, ListingStats


def test_a_common_value_has_its_share_and_any_other_an_even_part_of_the_rest() -> None:
    stats = ColumnStats.of(1000.0, ["a", "b"], [0.5, 0.3], 6.0, 0.0)
    assert stats.rows_of("a") == pytest.approx(500)
    assert stats.rows_of("b") == pytest.approx(300)
    assert stats.rows_of("z") == pytest.approx(1000 * 0.2 / 4)  # 4 other values share 20 %


def test_distinct_values_as_a_share_of_the_rows_and_nulls() -> None:
    # -0.5: half as many distinct values as rows; 10 % NULL
    stats = ColumnStats.of(1000.0, None, None, -0.5, 0.1)
    assert stats.rows_of("x") == pytest.approx(1000 * 0.9 / 500)


def test_another_value_is_never_more_than_the_least_common_one() -> None:
    # 3 distinct values, 90 % of the rows left for the third: the planner caps any value not
    # among the common ones at the least common's share (4 %); n_distinct 0: 200 values
    stats = ColumnStats.of(1000.0, ["a", "b"], [0.06, 0.04], 3.0, 0.0)
    assert stats.rows_of("z") == pytest.approx(40)
    assert ColumnStats.of(1000.0, None, None, 0.0, 0.0).rows_of("z") == pytest.approx(5)


def test_no_other_value_left() -> None:
    stats = ColumnStats.of(10.0, ["a"], [1.0], 1.0, 0.0)
    assert stats.rows_of("a") == pytest.approx(10)
    assert stats.rows_of("b") == 0


class _NoPool:
    """A pool that must not be asked: the statistics below are fresh."""

    async def fetch(self, *args: object) -> list[object]:
        raise AssertionError("statistics read again within their TTL")


def _stats(columns: dict[tuple[str, str], ColumnStats]) -> ListingStats:
    stats = ListingStats(cast(Pool, _NoPool()), ttl=3600)
    stats._columns, stats._read_at = columns, time.monotonic()
    return stats


async def test_the_fewer_rows_decide_and_only_for_the_unindexed_states() -> None:
    columns = {
        ("jobs_by_state", "state"): ColumnStats.of(1000.0, ["queued", "failed"], [0.6, 0.4], 2, 0),
        ("jobs", "type"): ColumnStats.of(10_000.0, ["common"], [0.9], 11, 0),  # others: 100
        ("jobs", "queue"): ColumnStats.of(10_000.0, ["default"], [0.99], 2, 0),  # other: 100
    }
    stats = _stats(columns)
    assert await stats.by_type_first("queued", "rare", None)  # 100 < 600
    assert not await stats.by_type_first("queued", "common", None)  # 9,000 > 600
    assert await stats.by_type_first("queued", "common", "rare-queue")  # the fewer: 100
    assert not await stats.by_type_first("queued", None, "default")
    assert not await stats.by_type_first("failed", "rare", None)  # in 0020's indexes
    assert not await stats.by_type_first("queued", None, None)
    assert not await stats.by_type_first("queued", cast(str, ["rare"]), None)  # refused later
    del columns[("jobs", "queue")]  # not analysed yet: as every other state
    assert not await _stats(columns).by_type_first("queued", "common", "rare-queue")


class _Pool:
    """Counts the reads of the statistics."""

    def __init__(self) -> None:
        self.reads = 0

    async def fetch(self, *args: object) -> list[object]:
        self.reads += 1
        return []


async def test_the_first_listing_reads_them_whatever_the_ttl_and_then_once_a_ttl() -> None:
    pool = _Pool()
    stats = ListingStats(cast(Pool, pool), ttl=60)
    stats.ttl = 10 * 365 * 86400.0  # raised after it was made (bench/console.py does)
    await stats.columns()
    await stats.columns()
    assert pool.reads == 1
    stats.ttl = 0.0
    await stats.columns()
    assert pool.reads == 2
