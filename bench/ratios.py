"""Ratios between systems measured in the same interleaved runs: the median of per-run ratios.

A ratio of two medians pairs one system's median run with another's from a different run;
on a shared machine, where a slow spell lands on one run of every system, that mixes spells.
Pairing each run with its own (run ``i`` of one system against run ``i`` of the other, the
same Redis mode) and taking the median of those ratios keeps each comparison inside one
spell. Used by ``compare.py`` when it summarises and by ``report.py`` when it reads older
results files (whose saved ratio may be a ratio of medians).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

Runs = Sequence[Mapping[str, Mapping[str, Mapping[str, Any]]]]  # run: system: mode: result


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def per_run_ratios(
    runs: Runs, system: str, peer: str, mode: str, field: str = "e2e_jobs_per_s"
) -> list[float]:
    """``system``'s ``field`` over ``peer``'s, run by run (same mode); runs where either
    failed (an ``error``, no figure, or a peer at 0) are left out."""
    out = []
    for run in runs:
        a = _number(run.get(system, {}).get(mode, {}).get(field))
        b = _number(run.get(peer, {}).get(mode, {}).get(field))
        if a is not None and b:
            out.append(a / b)
    return out


def median_ratio(ratios: Sequence[float]) -> float | None:
    """The median of per-run ratios; None when no run had both figures."""
    return statistics.median(ratios) if ratios else None
