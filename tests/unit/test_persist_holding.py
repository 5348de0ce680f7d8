"""Holding live jobs' rows (persist/holding.py): which rows wait, what supersedes them, and
which entries each batch acknowledges."""

from __future__ import annotations

import msgspec

from jobtier.persist.batch import JobRow
from jobtier.persist.holding import Holding, merge
from jobtier.streams.entries import LogEntry, parse_entry

A = "01ARZ3NDEKTSV4RRFFQ69G5FAV-1"
B = "01ARZ3NDEKTSV4RRFFQ69G5FAW-2"
_seq = iter(range(1, 1_000_000))


def entry(job: str, version: int, state: str, frm: str | None, **extra: bytes) -> LogEntry:
    """A log entry of ``job`` at ``version`` (the submit when ``frm`` is None)."""
    doc = msgspec.json.encode({
        "id": job, "type": "echo", "state": state, "version": version, "priority": "normal",
        "attempt": 1, "max_attempts": 3, "created_at": "2024-05-01T12:00:00.000Z",
        "updated_at": f"2024-05-01T12:00:0{version}.000Z", "run_at": None, "progress": None,
        "error": None, "cancel_requested": False, "worker": "w1",
    })  # fmt: skip
    fields = {b"d": doc, b"tn": b"t1", b"fr": (frm or "").encode(), b"w": b"w1"}
    fields.update({k.encode(): v for k, v in extra.items()})
    return parse_entry(0, b"%d-0" % next(_seq), fields)


def submit(job: str) -> LogEntry:
    return entry(job, 1, "queued", None, p=b'{"n":1}')


def claim(job: str) -> LogEntry:
    return entry(job, 2, "running", "queued")


def done(job: str) -> LogEntry:
    return entry(job, 3, "succeeded", "running", r=b'{"ok":true}')


def versions(rows: list[JobRow]) -> list[tuple[str, int]]:
    return [(r.latest.status.id, r.latest.status.version) for r in rows]


def test_a_claim_waits_and_its_jobs_end_takes_its_place() -> None:
    holding = Holding(1.0)
    first = holding.take([submit(A)], now=0.0)
    assert versions(first.rows) == [(A, 1)] and first.acks == first.entries  # never held

    c = claim(A)
    held = holding.take([c], now=0.1)
    assert held.rows == [] and held.acks == [] and len(holding) == 1
    assert held.entries == [c]  # its history row is written all the same
    holding.committed(held, now=0.2)  # and once it is, the claim's entry joins the hold

    d = done(A)
    end = holding.take([d], now=0.5)
    assert versions(end.rows) == [(A, 3)] and end.rows[0].result == b'{"ok":true}'
    assert end.acks == [d, c] and end.released == [c]  # the claim's entry acknowledged now
    assert len(holding) == 0 and holding.collapsed == 1


def test_a_row_is_written_once_its_hold_runs_out() -> None:
    holding = Holding(1.0)
    c = claim(A)
    holding.committed(holding.take([c], now=10.0), now=10.1)
    assert not holding.due(10.9) and holding.due(11.0)
    # a later version within the hold joins it without restarting it
    progressed = entry(A, 3, "running", "running")
    later = holding.take([progressed], now=10.5)
    assert later.rows == [] and later.acks == []
    holding.committed(later, now=10.6)
    assert holding.collapsed == 1
    out = holding.take([], now=11.0)
    assert versions(out.rows) == [(A, 3)] and out.acks == [c, progressed]
    assert out.entries == [] and len(holding) == 0


def test_a_row_past_its_hold_is_written_with_the_batch_that_holds_a_newer_version() -> None:
    holding = Holding(1.0)
    c = claim(A)
    holding.committed(holding.take([c], now=0.0), now=0.0)
    retry = entry(A, 3, "scheduled", "running")
    out = holding.take([retry], now=2.0)  # not ended, but held long enough
    assert versions(out.rows) == [(A, 3)] and out.acks == [retry, c] and len(holding) == 0


def test_submits_and_ends_are_never_held_nor_is_anything_with_no_hold() -> None:
    holding = Holding(1.0)
    both = holding.take([submit(B), claim(B)], now=0.0)  # created in this batch: written
    assert versions(both.rows) == [(B, 2)] and len(holding) == 0
    failed = entry(A, 4, "failed", "running")
    assert versions(holding.take([failed], now=0.0).rows) == [(A, 4)]
    cancelled = entry(B, 5, "cancelled", "running")
    assert versions(holding.take([cancelled], now=0.0).rows) == [(B, 5)]
    off = Holding(0.0)
    c = claim(A)
    assert versions(off.take([c], now=0.0).rows) == [(A, 2)] and len(off) == 0


def test_release_all_writes_every_held_row_in_id_order() -> None:
    holding = Holding(60.0)
    cb, ca = claim(B), claim(A)
    holding.committed(holding.take([cb], now=0.0), now=0.0)
    holding.committed(holding.take([ca], now=1.0), now=1.0)
    other = entry("01ARZ3NDEKTSV4RRFFQ69G5FAX-3", 2, "running", "queued")
    out = holding.take([other], now=2.0, release_all=True)
    # the lock order write_batch needs: by id, held and new rows together
    assert [j for j, _ in versions(out.rows)] == sorted([A, B, other.status.id])
    assert set(map(id, out.acks)) == {id(other), id(ca), id(cb)} and len(holding) == 0


def test_only_the_rows_whose_hold_ran_out_are_released_oldest_first() -> None:
    holding = Holding(1.0)
    ca, cb = claim(A), claim(B)
    holding.committed(holding.take([ca], now=0.0), now=0.0)
    holding.committed(holding.take([cb], now=0.6), now=0.6)
    # A held again by a newer version keeps the time its hold began
    pa = entry(A, 3, "running", "running")
    holding.committed(holding.take([pa], now=0.8), now=0.8)
    out = holding.take([], now=1.0)
    assert versions(out.rows) == [(A, 3)] and out.acks == [ca, pa] and len(holding) == 1
    assert holding.due(1.6) and versions(holding.take([], now=1.6).rows) == [(B, 2)]


def test_merge_keeps_the_newer_version_and_what_only_the_submit_or_end_carries() -> None:
    holding = Holding(1.0)
    (submitted,) = holding.take([submit(A)], now=0.0).rows
    (ended,) = holding.take([done(A)], now=0.0).rows
    both = merge(ended, submitted)  # an older entry read late (taken over from another)
    assert both.latest.status.version == 3 and both.payload == b'{"n":1}'
    assert both.result == b'{"ok":true}' and both.created


def test_an_entry_is_acknowledged_only_once_its_history_and_its_row_are_committed() -> None:
    holding = Holding(1.0)
    c, d = claim(A), done(A)
    first = holding.take([c], now=0.0)  # still being written
    end = holding.take([d], now=0.1)  # the job's end, in a batch written alongside
    # the end's row is written, but the claim's history may not be in Postgres yet: only the
    # end is acknowledged with it
    assert versions(end.rows) == [(A, 3)] and end.acks == [d] and len(holding) == 0
    holding.committed(first, now=0.2)
    # the claim's row is held again (a version Postgres may have already) and acknowledged
    # with it, once its history is committed
    assert len(holding) == 1 and not holding.due(1.1) and holding.due(1.2)
    again = holding.take([], now=1.2)
    assert versions(again.rows) == [(A, 2)] and again.acks == [c]


def test_a_batch_that_does_not_commit_leaves_its_entries_out_of_the_hold() -> None:
    holding = Holding(1.0)
    c = claim(A)
    holding.take([c], now=0.0)  # never committed: no `committed` call
    out = holding.take([], now=1.0)
    assert versions(out.rows) == [(A, 2)] and out.acks == []  # pending: read back, written again


def test_a_checkpoints_row_is_written_with_it() -> None:
    holding = Holding(1.0)
    saved = entry(A, 2, "running", "queued", cp=b'{"step":1}')
    out = holding.take([saved], now=0.0)
    assert versions(out.rows) == [(A, 2)] and out.acks == [saved] and len(holding) == 0


def test_forgetting_a_hold_gives_back_its_committed_entries() -> None:
    holding = Holding(1.0)
    c = claim(A)
    batch = holding.take([c], now=0.0)
    holding.committed(batch, now=0.0)
    assert holding.forget(batch.held) == [c] and len(holding) == 0
    assert holding.forget([B]) == []


def test_a_batch_joining_a_hold_of_an_older_row_brings_its_newer_row() -> None:
    """Three batches at once: X holds the claim (v2), A a later version (v3), B releases the
    v3 row but is not committed whole; X then holds v2 again, and A joins that hold: the row
    written for both is A's v3, not v2 (else v3 would be acknowledged unwritten)."""
    holding = Holding(1.0)
    c, later = claim(A), entry(A, 3, "running", "running")
    x = holding.take([c], now=0.0)
    a = holding.take([later], now=0.1)
    holding.take([], now=1.0)  # B: released the v3 row, then written in parts
    holding.committed(x, now=1.1)
    holding.committed(a, now=1.2)
    out = holding.take([], now=2.1)
    assert versions(out.rows) == [(A, 3)] and out.acks == [c, later]
