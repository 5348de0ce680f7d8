"""What a persister has done since it started, and the metrics snapshot made from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from jobtier.metrics.histogram import SECONDS_BUCKETS, SIZE_BUCKETS, Histogram
from jobtier.metrics.snapshot import Snapshot, labels
from jobtier.metrics.transitions import TransitionCounter


@dataclass
class PersisterStats:
    """What the persister has done since it started (its metrics)."""

    batches: int = 0
    transitions: int = 0  # log entries committed (history rows, replays included)
    jobs: int = 0  # job rows upserted, after collapsing
    retries: int = 0  # batch attempts that failed and were retried
    claimed: int = 0  # entries taken over from idle consumers
    bad_entries: int = 0  # entries that cannot be stored (logged; parked when refused)
    parked: int = 0  # entries Postgres refused, moved to the shard's log:refused stream
    errors: dict[str, int] = field(default_factory=dict)  # failures retried, by error class
    reconciled: dict[str, int] = field(default_factory=dict)  # jobs put back (reconcile.py)
    batch_sizes: Histogram = field(default_factory=lambda: Histogram(SIZE_BUCKETS), repr=False)
    # where a committed batch's time went: its oldest transition's age when the write began,
    # and the write itself (a pool connection, the commit and any retries included)
    batch_waits: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS), repr=False)
    batch_writes: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS), repr=False)
    job_counts: TransitionCounter = field(default_factory=TransitionCounter, repr=False)

    def failed(self, exc: BaseException) -> None:
        """Count a failure that is retried, by its class."""
        name = type(exc).__name__
        self.errors[name] = self.errors.get(name, 0) + 1

    def repaired(self, kind: str) -> None:
        """Count a job put back into Redis by a reconcile pass, by kind."""
        self.reconciled[kind] = self.reconciled.get(kind, 0) + 1

    def snapshot(self) -> Snapshot:
        """The persister's part of its process's metrics snapshot, with the job counters by
        type counted from what it committed."""
        counters = {name: dict(series) for name, series in self.job_counts.counts.items()}
        totals = {
            "persister_batches_total": self.batches,
            "persister_retries_total": self.retries,
            "persister_claimed_total": self.claimed,
            "persister_bad_entries_total": self.bad_entries,
            "persister_parked_total": self.parked,
        }
        counters.update({name: {"": n} for name, n in totals.items()})
        counters["persister_errors_total"] = {labels(error=k): v for k, v in self.errors.items()}
        counters["reconciled_total"] = {labels(kind=k): v for k, v in self.reconciled.items()}
        histograms = {
            "persister_batch_size": self.batch_sizes,
            "persister_batch_wait_seconds": self.batch_waits,
            "persister_batch_write_seconds": self.batch_writes,
        }
        hists = {name: {"": h.snapshot()} for name, h in histograms.items()}
        return Snapshot("", "", 0.0, counters=counters, histograms=hists)
