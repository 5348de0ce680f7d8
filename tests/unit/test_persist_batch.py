"""Pure pieces of the persister: entry decoding, collapsing a batch, the query loader."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from jobtier.dev.local_postgres import pg_bin_dir
from jobtier.persist import db
from jobtier.persist.batch import (
    INLINE_RESULT_MAX,
    JOB_COLUMNS,
    TRANSITION_COLUMNS,
    JobRow,
    collapse,
    job_records,
    split_created,
    transition_records,
)
from jobtier.streams.entries import (
    MALFORMED,
    PARTS_MOST,
    parse_entries,
    parse_entry,
    split_fields,
    tenants,
)

JOB = "01ARZ3NDEKTSV4RRFFQ69G5FAV-1"


def doc(version: int, state: str = "running", job_id: str = JOB, **extra: str) -> bytes:
    fields = {
        "id": f'"{job_id}"', "type": '"echo"', "state": f'"{state}"', "version": str(version),
        "priority": '"normal"', "attempt": "1", "max_attempts": "3",
        "created_at": '"2024-05-01T12:00:00.000Z"', "updated_at": f'"2024-05-01T12:00:0{version}.000Z"',
        "run_at": "null", "progress": "null", "error": "null", "cancel_requested": "false",
        "worker": '"w1"',
    }  # fmt: skip
    fields.update(extra)
    return ("{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}").encode()


def entry(version: int, **fields: bytes) -> dict[bytes, bytes]:
    base = {b"d": doc(version), b"tn": b"t1", b"fr": b"queued", b"w": b"w1"}
    base.update({k.encode(): v for k, v in fields.items()})
    return base


def test_prev_version_comes_from_the_entry_or_means_version_minus_one() -> None:
    assert parse_entry(0, b"1-0", entry(8, pv=b"2")).prev_version == 2
    assert parse_entry(0, b"1-0", entry(1, pv=b"0")).prev_version == 0
    # an entry from a jobtier that logged every version: NULL, read as version - 1
    assert parse_entry(0, b"1-0", entry(3)).prev_version is None
    records = transition_records([parse_entry(0, b"1-0", entry(8, pv=b"2"))])
    assert dict(zip(TRANSITION_COLUMNS, records[0], strict=True))["prev_version"] == 2


def test_parse_entry_reads_every_field() -> None:
    e = parse_entry(2, b"1714564800000-3", entry(1, fr=b"", w=b"api", p=b'{"a":1}', ik=b"k"))
    assert (e.shard, e.ms, e.tenant, e.actor) == (2, 1714564800000, "t1", "api")
    assert e.from_state is None and e.payload == b'{"a":1}' and e.idempotency_key == "k"
    assert e.result is None and e.status.version == 1
    done = parse_entry(0, b"1-0", entry(3, r=b""))
    assert done.result == b"" and done.payload is None and done.from_state == "queued"


def test_decoded_entries_and_rows_are_left_to_reference_counting() -> None:
    """A persister decodes tens of thousands of entries a second: neither they nor the rows
    collapsed from them are tracked by the cyclic collector (LogEntry's docstring says why
    that is safe), so they do not make it run more often."""
    e = parse_entry(0, b"1-0", entry(1, fr=b"", p=b"[1]", dp=b"a b", dk=b"10"))
    assert e.dependencies == ["a", "b"] and e.children == "10"
    assert not gc.is_tracked(e)
    assert not any(gc.is_tracked(row) for row in collapse([e]))


@pytest.mark.parametrize(
    "fields",
    [
        {b"tn": b"t1", b"fr": b"", b"w": b"api"},  # no document
        {b"d": b"{}", b"tn": b"t1", b"fr": b"", b"w": b"api"},  # not a status document
        {b"d": doc(1, state="exploded"), b"tn": b"t1", b"fr": b"", b"w": b"api"},
        {b"d": doc(1), b"fr": b"", b"w": b"api"},  # no tenant
    ],
)
def test_parse_entry_refuses_malformed_entries(fields: dict[bytes, bytes]) -> None:
    with pytest.raises((KeyError, ValueError)):
        parse_entry(0, b"1-0", fields)


def bundle(*parts: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """An entry of several transitions, as lib.lua's write_log makes one."""
    out = {b"n": b"%d" % len(parts)}
    for place, part in enumerate(parts, 1):
        out.update({name + b"%d" % place: value for name, value in part.items()})
    return out


def test_an_entry_of_several_transitions_is_read_in_the_order_they_were_made() -> None:
    other = "01ARZ3NDEKTSV4RRFFQ69G5FAW-1"
    parts = [
        entry(1, fr=b"", w=b"api", p=b'{"a":1}', ik=b"k", pv=b"0"),
        {**entry(2, r=b"", pv=b"1"), b"tn": b"t2", b"d": doc(2, job_id=other)},
        entry(4, rl=b"1", cp=b"[1]", pv=b"3"),
    ]
    fields = bundle(*parts)
    got = parse_entries(3, b"7-0", fields)
    assert [(e.status.id, e.status.version) for e in got] == [(JOB, 1), (other, 2), (JOB, 4)]
    assert {(e.shard, e.entry_id) for e in got} == {(3, b"7-0")}
    assert [e.tenant for e in got] == ["t1", "t2", "t1"]
    assert (
        got[0].payload == b'{"a":1}' and got[0].idempotency_key == "k" and got[0].from_state is None
    )
    assert got[1].result == b"" and got[1].payload is None and got[1].prev_version == 1
    assert got[2].released and got[2].checkpoint == b"[1]" and not got[0].released
    # one transition alone is an entry of its own fields, as it always was
    assert parse_entries(0, b"1-0", parts[0]) == [parse_entry(0, b"1-0", parts[0])]
    assert split_fields(fields) == parts and split_fields(parts[0]) == [parts[0]]
    assert tenants(fields) == [b"t1", b"t2", b"t1"] and tenants(parts[0]) == [b"t1"]


@pytest.mark.parametrize(
    "fields",
    [
        {**bundle(entry(1), entry(2)), b"n": b"3"},  # a transition missing
        {**bundle(entry(1), entry(2)), b"n": b"0"},
        bundle(*[entry(1)] * (PARTS_MOST + 1)),  # more than a call logs in one entry
        {**bundle(entry(1), entry(2)), b"n": b"two"},
        {k: v for k, v in bundle(entry(1), entry(2)).items() if k != b"tn2"},  # no tenant
    ],
)
def test_a_malformed_entry_of_several_transitions_is_refused_whole(
    fields: dict[bytes, bytes],
) -> None:
    with pytest.raises(MALFORMED):
        parse_entries(0, b"1-0", fields)


def test_collapse_keeps_the_latest_version_and_the_submit_and_success_fields() -> None:
    other = "01ARZ3NDEKTSV4RRFFQ69G5FAW-1"
    entries = [
        parse_entry(0, b"3-0", entry(3, r=b'{"ok":1}')),
        parse_entry(0, b"1-0", entry(1, fr=b"", p=b"[1]", ik=b"key")),
        parse_entry(0, b"4-0", {**entry(4), b"d": doc(4, job_id=other)}),
        parse_entry(0, b"2-0", entry(2)),
    ]
    rows = collapse(entries)
    assert [r.latest.status.id for r in rows] == [JOB, other]  # sorted: a fixed lock order
    row = rows[0]
    assert row.latest.status.version == 3
    assert (row.payload, row.idempotency_key, row.result) == (b"[1]", "key", b'{"ok":1}')
    assert rows[1].payload is None


def test_results_over_the_inline_limit_leave_the_jobs_column_empty() -> None:
    big = b'"' + b"x" * INLINE_RESULT_MAX + b'"'
    [record] = job_records(collapse([parse_entry(0, b"1-0", entry(2, r=big))]))
    row = dict(zip(JOB_COLUMNS, record, strict=True))
    assert row["result"] is None and row["result_size"] == len(big)
    [record] = job_records(collapse([parse_entry(0, b"1-0", entry(2, r=b""))]))
    assert dict(zip(JOB_COLUMNS, record, strict=True))["result"] == b"null"


def test_transition_records() -> None:
    e = parse_entry(0, b"1-0", entry(2, fr=b"queued", w=b"w9"))
    [record] = transition_records([e])
    row = dict(zip(TRANSITION_COLUMNS, record, strict=True))
    assert row["at"].isoformat() == "2024-05-01T12:00:02+00:00"
    assert (row["version"], row["from_state"], row["to_state"], row["worker"]) == (
        2, "queued", "running", "w9",
    )  # fmt: skip
    assert row["error"] is None and row["progress"] is None


def test_query_loader() -> None:
    text = "-- header\n-- name: a\nSELECT 1\n\n-- name: b\n-- about b\nSELECT 2\n"
    assert db.parse_queries(text) == {"a": "SELECT 1", "b": "-- about b\nSELECT 2"}
    with pytest.raises(ValueError, match="twice"):
        db.parse_queries("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n")
    with pytest.raises(ValueError, match="empty"):
        db.parse_queries("-- name: a\n-- name: b\nSELECT 2\n")
    assert {"upsert_jobs", "insert_transitions", "list_jobs", "history"} <= set(db.queries())
    with pytest.raises(KeyError, match="no query named"):
        db.query("nope")


def test_pg_bin_dir_picks_the_highest_version(tmp_path: Path) -> None:
    for version in ("9.6", "15", "16", "notaversion"):
        bindir = tmp_path / version / "bin"
        bindir.mkdir(parents=True)
        (bindir / "postgres").touch()
        (bindir / "initdb").touch()
    (tmp_path / "17" / "bin").mkdir(parents=True)  # client only: no server binaries
    assert pg_bin_dir(tmp_path) == tmp_path / "16" / "bin"
    with pytest.raises(RuntimeError, match="apt-get install postgresql"):
        pg_bin_dir(tmp_path / "missing")


def test_new_jobs_go_straight_in_only_after_the_last_row_to_merge() -> None:
    """split_created keeps a batch's locks in id order: rows to merge, then new jobs' rows."""

    def rows(*kinds: str) -> list[JobRow]:
        out = []
        for i, kind in enumerate(kinds):
            job_id = f"01ARZ3NDEKTSV4RRFFQ69G5FA{i}-1"
            fields = entry(1 if kind == "new" else 2, fr=b"" if kind == "new" else b"queued")
            fields[b"d"] = doc(1 if kind == "new" else 2, job_id=job_id)
            out.append(parse_entry(0, f"{i + 1}-0".encode(), fields))
        return collapse(out)

    merged, created = split_created(rows("old", "new", "old", "new", "new"))
    assert [r.created for r in merged] == [False, True, False]
    assert [r.created for r in created] == [True, True]
    assert split_created(rows("new", "new")) == ([], rows("new", "new"))
    assert split_created(rows("old", "old")) == (rows("old", "old"), [])
