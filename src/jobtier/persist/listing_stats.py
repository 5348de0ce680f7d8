"""Which way a listing of queued or running jobs of one type (or queue) reads, by Postgres's
statistics.

Migration 0020's partial indexes leave out queued and running jobs: nearly every job passes
through those states, and an index entry for each would cost the write-behind. Such a
listing therefore reads either every job of the state in ``jobs_by_state``, keeping those of
the type, or every job of the type in ``jobs`` by its type (or queue) index, keeping those in
the state. Which is fewer depends on the data (a rare type during a large backlog; a common
type while few jobs wait), and the two are different queries, so the planner cannot choose
between them: ``ListingStats`` does, from the same statistics the planner reads
(``pg_stats``), read about once a ``TTL`` (concurrent listings may each read them when they
fall due). The counts are across tenants: a tenant's listing is taken to hold its jobs in
the same proportions. A failed read leaves the listing on ``jobs_by_state``'s way.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from jobtier.persist.db import Pool, query

log = logging.getLogger("jobtier.persist")

TTL = 60.0  # seconds between reads of the statistics
DEFAULT_DISTINCT = 200.0  # the planner's guess when n_distinct is not known
# the states jobs_by_state's partial indexes (migrations/0020) leave out
UNINDEXED = frozenset({"queued", "running"})


@dataclass(frozen=True)
class ColumnStats:
    """One column's statistics: its table's estimated rows, the share of the rows of each of
    its most common values, and the share of any one other value."""

    rows: float
    common: dict[str, float]
    other: float

    @classmethod
    def of(
        cls, rows: float, values: list[str] | None, shares: list[float] | None,
        distinct: float, null_share: float,
    ) -> ColumnStats:  # fmt: skip
        """From ``pg_stats``, as the planner reads it (``var_eq_const``): ``distinct`` is
        ``n_distinct`` (negative: a share of the rows; 0: not known, taken as 200); any other
        value has an even part of the rows the common values leave, at most the share of the
        least common of them."""
        common = dict(zip(values or [], shares or [], strict=True))
        n = distinct if distinct > 0 else -distinct * rows if distinct < 0 else DEFAULT_DISTINCT
        others = max(1.0, n - len(common))
        other = max(0.0, 1.0 - sum(common.values()) - null_share) / others
        if common:
            other = min(other, min(common.values()))
        return cls(rows, common, other)

    def rows_of(self, value: str) -> float:
        """The estimated rows holding ``value``."""
        return self.rows * self.common.get(value, self.other)


class ListingStats:
    """The statistics of ``jobs.type``, ``jobs.queue`` and ``jobs_by_state.state``, read from
    Postgres at most once a ``TTL``, and the choice they make."""

    def __init__(self, pool: Pool, ttl: float = TTL) -> None:
        self.pool = pool
        self.ttl = ttl
        self._columns: dict[tuple[str, str], ColumnStats] = {}
        self._read_at = -math.inf  # never: read at the first listing that needs them

    async def columns(self) -> dict[tuple[str, str], ColumnStats]:
        now = time.monotonic()
        if now - self._read_at >= self.ttl:
            rows = await self.pool.fetch(query("listing_stats"))
            self._columns = {
                (r["tablename"], r["attname"]): ColumnStats.of(
                    float(r["rows"]), r["vals"], r["freqs"], float(r["n_distinct"]),
                    float(r["null_frac"]),
                )
                for r in rows
            }  # fmt: skip
            self._read_at = now
        return self._columns

    async def by_type_first(self, state: str, type: str | None, queue: str | None) -> bool:
        """Whether a listing of ``state`` with this type and/or queue reads fewer rows through
        ``jobs``' type or queue index than through the state's rows in ``jobs_by_state``:
        only for a state the partial indexes leave out, and only when Postgres has statistics
        of every column it compares (else the way of every other state)."""
        if state not in UNINDEXED or (type is None and queue is None):
            return False
        if not all(isinstance(v, str) for v in (type, queue) if v is not None):
            return False  # refused by the listing's own checks, with the field named
        try:
            columns = await self.columns()
        except Exception as exc:  # the listing itself will say what is wrong, or work
            log.warning("event=listing_stats_unread error=%r", exc)
            self._read_at = time.monotonic()  # tried again after the TTL
            return False
        by_state = columns.get(("jobs_by_state", "state"))
        narrowing = [(("jobs", "type"), type), (("jobs", "queue"), queue)]
        found = [(columns.get(c), v) for c, v in narrowing if v is not None]
        if by_state is None or any(s is None for s, _ in found):
            return False
        fewest = min(s.rows_of(v) for s, v in found if s is not None)
        return fewest < by_state.rows_of(state)
