"""Histograms: cheap to observe in a hot loop, published as plain snapshots, merged and
subtracted per process by whoever reads them (the Prometheus endpoint, the dashboard)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

_SUBSECOND = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
SECONDS_BUCKETS = (*_SUBSECOND, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)
SIZE_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 2000, 5000, 10000)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics), cheap to observe."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = SECONDS_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        return _snapshot(self.bounds, list(self.counts), self.sum, self.count)


def _snapshot(bounds: Any, counts: list[int], total: float, count: int) -> dict[str, Any]:
    return {"bounds": bounds, "counts": counts, "sum": total, "count": count}


def quantile(hist: dict[str, Any], q: float) -> float | None:
    """Estimated ``q`` quantile of a histogram snapshot: the upper bound of its bucket (the
    largest finite bound when it falls past them: a lower bound then). None without data."""
    total = hist["count"]
    if not total:
        return None
    rank = q * total
    seen = 0
    for bound, n in zip(hist["bounds"], hist["counts"], strict=False):
        seen += n
        if seen >= rank:
            return float(bound)
    return float(hist["bounds"][-1])


def merge(parts: Iterable[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, h in part.items():
            acc = out.get(name)
            if acc is None:
                out[name] = _snapshot(h["bounds"], list(h["counts"]), h["sum"], h["count"])
            elif list(acc["bounds"]) == list(h["bounds"]):
                acc["counts"] = [a + b for a, b in zip(acc["counts"], h["counts"], strict=True)]
                acc["sum"] += h["sum"]
                acc["count"] += h["count"]
    return out


def minus(h: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    if base is None:
        return h
    if list(base["bounds"]) != list(h["bounds"]):
        return _snapshot(h["bounds"], [0] * len(h["counts"]), 0.0, 0)
    counts = [max(0, a - b) for a, b in zip(h["counts"], base["counts"], strict=True)]
    return _snapshot(h["bounds"], counts, max(0.0, h["sum"] - base["sum"]), sum(counts))
