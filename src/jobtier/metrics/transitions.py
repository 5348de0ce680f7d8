"""Job counters by type and queue, counted from persisted transitions.

The persister sees every transition once (whichever process made it), so counting what it
commits gives exact submitted / claimed / succeeded / failed / retried / dead-lettered /
cancelled counts and lease expirations. The queue label gives the console its per-queue
rates (a task's jobs may be sent to another queue than its own).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from jobtier.metrics.snapshot import labels


class TransitionCounter:
    """Counts jobs by type, queue and outcome from the persister's commits."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        # the label set of each (type, queue) seen, made once rather than per transition
        self._kinds: dict[tuple[str, str], str] = {}

    def observe(self, entries: Iterable[Any], _wall: float = 0.0) -> None:
        counts = self.counts
        kinds = self._kinds
        n = 0
        for entry in entries:
            n += 1
            doc = entry.status
            kind = kinds.get((doc.type, doc.queue))
            if kind is None:
                kind = kinds[doc.type, doc.queue] = labels(type=doc.type, queue=doc.queue)
            to, frm = doc.state, entry.from_state  # a StrEnum: equal to its value, no lookup
            if frm is None:
                counts["jobs_submitted_total"][kind] += 1
            elif frm == "queued" and to == "running":
                counts["jobs_claimed_total"][kind] += 1
            elif frm == "running" and to != "running":
                expired = doc.error is not None and doc.error.type == "LeaseExpired"
                if expired and to in ("queued", "failed"):
                    counts["lease_expirations_total"][kind] += 1
                if to == "succeeded":
                    counts["jobs_succeeded_total"][kind] += 1
                elif to == "scheduled":
                    # an attempt given back rather than failed (fail.lua 'rf'): the task
                    # raised jobtier's RateLimited, or an open circuit breaker held the job
                    # (worker/breaker_gate.py). Counted apart, so that a downstream saying
                    # "later" does not read as a failure rate; told by the flag, not by the
                    # error's name, which a task's own exception may share
                    if entry.refunded:
                        counts["jobs_held_total"][kind] += 1
                    else:
                        counts["jobs_failed_total"][kind] += 1
                        counts["jobs_retried_total"][kind] += 1
                elif to == "failed" and not expired:
                    counts["jobs_failed_total"][kind] += 1
                elif to == "cancelled" and entry.actor == "expiry":
                    # an attempt that failed (or was given back) with its retry due after the
                    # job's expiry: fail.lua ended the job rather than schedule the retry
                    held = entry.refunded
                    counts["jobs_held_total" if held else "jobs_failed_total"][kind] += 1
            if to == "failed" and frm != "failed":
                counts["jobs_dead_lettered_total"][kind] += 1
            if to == "cancelled":
                counts["jobs_cancelled_total"][kind] += 1
                if entry.actor == "expiry":  # past its expiry, or its retry due after it
                    counts["jobs_expired_total"][kind] += 1
        if n:
            counts["transitions_persisted_total"][""] += n
