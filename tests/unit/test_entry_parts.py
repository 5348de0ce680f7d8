"""The persister's bookkeeping of log entries of several transitions (persist/entry_parts.py):
an entry is owed its XACK, or its parking, only once every transition in it is written."""

from __future__ import annotations

from typing import Any, cast

from jobtier.persist.entry_parts import EntryParts
from jobtier.streams.entries import LogEntry, parse_entries
from tests.unit.test_persist_batch import bundle, doc, entry


class Acks:
    """What EntryParts tells its Acks (streams/acks.py), recorded."""

    def __init__(self) -> None:
        self.added: list[tuple[int, bytes]] = []
        self.parked: list[tuple[int, bytes, str]] = []

    def add(self, shard: int, entry_id: bytes) -> None:
        self.added.append((shard, entry_id))

    def park(self, shard: int, entry_id: bytes, error: str) -> None:
        self.parked.append((shard, entry_id, error))


def two_jobs(entry_id: bytes) -> list[LogEntry]:
    """An entry of two transitions: job A's version 3 and job B's version 2."""
    b = {**entry(2), b"d": doc(2, job_id="01ARZ3NDEKTSV4RRFFQ69G5FAW-1")}
    return parse_entries(0, entry_id, bundle(entry(3), b))


def test_an_entry_is_owed_its_xack_once_every_transition_in_it_is_written() -> None:
    acks = Acks()
    parts = EntryParts(cast(Any, acks))
    a, b = two_jobs(b"2-0")
    parts.taken([a, b])
    parts.done([b])
    assert acks.added == []
    parts.done([b])  # a copy of it written again counts once
    assert acks.added == []
    parts.done([a])
    assert acks.added == [(0, b"2-0")]
    alone = parse_entries(1, b"1-0", entry(1))
    parts.taken(alone)
    parts.done(alone)
    assert acks.added == [(0, b"2-0"), (1, b"1-0")]


def test_a_transition_let_go_keeps_its_entry_unacknowledged_while_the_others_are_written() -> None:
    """A's row was held past its batch, then the batch that released it was not committed
    (Postgres away, the persister stopping; nothing is told EntryParts then): B's being
    written later must not acknowledge the entry, which still holds A's transition,
    unwritten."""
    acks = Acks()
    parts = EntryParts(cast(Any, acks))
    a, b = two_jobs(b"2-0")
    parts.taken([a, b])
    parts.done([b])
    assert acks.added == [] and acks.parked == []
    # read again (pending in Redis), whole: written, then acknowledged
    again = two_jobs(b"2-0")
    parts.taken(again)
    parts.done(again)
    assert acks.added == [(0, b"2-0")]


def test_an_entry_with_a_refused_transition_is_parked_once_the_rest_are_written() -> None:
    acks = Acks()
    parts = EntryParts(cast(Any, acks))
    a, b = two_jobs(b"2-0")
    parts.taken([a, b])
    parts.refused(a, "DataError('bad')")
    assert acks.parked == []
    parts.done([b])
    assert acks.parked == [(0, b"2-0", "DataError('bad')")] and acks.added == []


def test_an_entry_read_again_forgets_a_refusal_of_an_earlier_read() -> None:
    """A transition refused, then its batch not committed (a flush failed): the entry, read
    again whole and written this time, is acknowledged, not parked with the old error."""
    acks = Acks()
    parts = EntryParts(cast(Any, acks))
    a, b = two_jobs(b"2-0")
    parts.taken([a, b])
    parts.refused(a, "DataError('bad')")  # then b's batch is not committed: b let go
    again = two_jobs(b"2-0")
    parts.taken(again)
    parts.done(again)
    assert acks.added == [(0, b"2-0")] and acks.parked == []
