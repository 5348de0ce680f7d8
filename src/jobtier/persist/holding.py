"""Live jobs' rows held back a moment, so that a newer version can supersede them unwritten.

Every transition's history row is written with its batch. A job's row in ``jobs`` need not
be: a claim (or any version a job goes through on its way: queued again, scheduled for a
retry) of a job that ends within a second costs an update of the row and of its line in
``jobs_by_state`` that nobody reads (bench/results/persist_shapes.md: about a third of the
write-behind's CPU where every claim reaches Postgres in a batch before its job's end). With
``JOBTIER_PERSIST_HOLD_SECONDS`` above 0 (off by default: with no-op jobs the claims share a
batch with their ends anyway, and holding only adds lag; docs/operating.md), the persister
holds such a row that long: a later version of the job, in a later batch, takes its place,
and the row is written once, at the job's end or when the hold runs out.

What is never held: the row a batch creates (a submit: the job is listed at once, and its
payload is in Postgres for ``reconcile.py``), the row of a job that ended, and the row of a
job whose entry saved a checkpoint (``job_checkpoints`` refers to ``jobs``).

Nothing is lost by holding: the log entries of a held row stay unacknowledged until the row
(or a newer version of it) is committed, so a persister that dies holding rows leaves their
entries pending, written again by whoever takes them over. They count in the write-behind's
lag meanwhile, as the row they stand for is not in Postgres yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from jobtier.core.model import TERMINAL
from jobtier.persist.batch import JobRow, collapse
from jobtier.streams.entries import LogEntry


@dataclass(slots=True)
class Held:
    """A job's newest row not yet written, the entries it stands for whose history rows are
    committed (their acknowledgements wait for the row), and when it was first held."""

    row: JobRow
    entries: list[LogEntry]
    since: float


@dataclass(slots=True)
class Batch:
    """What one transaction writes: the history rows of ``entries``, the job rows ``rows``
    (id order), and what it holds back: ``held`` (job: its row as held, and its entries
    here), which join their rows' holds once it commits (``Holding.committed``).
    ``released``: entries held before (history committed) whose rows it writes."""

    entries: list[LogEntry]
    rows: list[JobRow]
    released: list[LogEntry] = field(default_factory=list)
    held: dict[str, tuple[JobRow, list[LogEntry]]] = field(default_factory=dict)

    @property
    def acks(self) -> list[LogEntry]:
        """What is acknowledged once it commits: its entries whose rows it writes, and the
        released ones."""
        if not self.held:
            return [*self.entries, *self.released]
        return [e for e in self.entries if e.status.id not in self.held] + self.released


def merge(old: JobRow, new: JobRow) -> JobRow:
    """One row from two of a job's collapsed rows, as ``collapse`` folds entries: the newer
    version wins; what only the submit (payload, idempotency key) or the success (result)
    carries is kept from whichever has it."""
    newer = new if new.latest.status.version >= old.latest.status.version else old
    submitted = new if new.payload is not None else old
    return JobRow(
        newer.latest,
        submitted.payload,
        submitted.idempotency_key,
        new.result if new.result is not None else old.result,
        old.created or new.created,
    )


class Holding:
    """The rows held by one persister, oldest hold first. ``seconds``: the longest hold (0:
    none). ``collapsed`` counts held rows a newer version took the place of, unwritten."""

    def __init__(self, seconds: float) -> None:
        self.seconds = max(0.0, seconds)
        self._rows: dict[str, Held] = {}  # insertion order is hold order: a re-hold keeps it
        self.collapsed = 0

    def __len__(self) -> int:
        return len(self._rows)

    def due(self, now: float) -> bool:
        """Has the oldest hold run out?"""
        first = next(iter(self._rows.values()), None)
        return first is not None and now - first.since >= self.seconds

    def take(self, entries: Sequence[LogEntry], now: float, release_all: bool = False) -> Batch:
        """The batch that writes ``entries``: each job's row collapsed with the one held for it,
        written unless it may be held (then held, its entries' acknowledgements with it), and
        every held row whose hold ran out (all of them with ``release_all``) written too.

        An entry joins its row's hold only once its own batch commits (``committed``): a row
        released meanwhile is acknowledged for the entries whose history is in Postgres."""
        if not self.seconds and not self._rows:  # no hold (the default): every row written
            return Batch(list(entries), collapse(entries))
        rows: list[JobRow] = []
        released: list[LogEntry] = []
        holding: dict[str, Held] = {}
        saved = {e.status.id for e in entries if e.checkpoint is not None}
        for row in collapse(entries):
            job = row.latest.status.id
            held = self._rows.get(job)
            since = now
            if held is not None:
                self.collapsed += 1
                row, since = merge(held.row, row), held.since
            # a checkpoint's row is written with it: job_checkpoints refers to jobs
            if release_all or job in saved or not self._may_hold(row, now - since):
                rows.append(row)
                if held is not None:
                    released += held.entries
                    del self._rows[job]
            else:
                holding[job] = Held(row, held.entries if held is not None else [], since)
        batch = Batch(list(entries), rows, released)
        for e in entries:
            if (h := holding.get(e.status.id)) is not None:
                batch.held.setdefault(e.status.id, (h.row, []))[1].append(e)
        self._rows.update(holding)  # an existing key keeps its place: its hold began then
        extra = self._release(now, release_all)
        if extra:
            for held in extra:
                rows.append(held.row)
                released += held.entries
            rows.sort(key=_row_id)  # the lock order write_batch needs (collapse's)
        return batch

    def committed(self, batch: Batch, now: float) -> None:
        """``batch`` committed: the entries whose rows it held join their holds (the newer of
        the two rows held), acknowledged with the row. A hold another batch released
        meanwhile (its row written, or about to be, by a batch that may not commit) is held again with this batch's row: written
        later, a version Postgres may already have (changing nothing then)."""
        for job, (row, entries) in batch.held.items():
            held = self._rows.get(job)
            if held is None:
                self._rows[job] = Held(row, list(entries), now)
            else:  # the hold may be of an older row (held again meanwhile): the newer one
                held.row = merge(held.row, row)
                held.entries += entries

    def forget(self, jobs: Iterable[str]) -> list[LogEntry]:
        """Stop holding these jobs' rows: the entries they stood for (to write again)."""
        out: list[LogEntry] = []
        for job in jobs:
            if (held := self._rows.pop(job, None)) is not None:
                out += held.entries
        return out

    def _may_hold(self, row: JobRow, held_for: float) -> bool:
        return (
            not row.created and row.latest.status.state not in TERMINAL and held_for < self.seconds
        )

    def _release(self, now: float, release_all: bool) -> list[Held]:
        """The held rows whose hold ran out (all with ``release_all``), forgotten here."""
        gone: list[str] = []
        for job, held in self._rows.items():
            if not release_all and now - held.since < self.seconds:
                break  # later ones were held later
            gone.append(job)
        return [self._rows.pop(job) for job in gone]


def _row_id(row: JobRow) -> str:
    return row.latest.status.id
