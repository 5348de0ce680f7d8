"""The console's reads of Postgres: every tenant's jobs by filter (each served by an index,
as EXPLAIN shows), one job's history with its errors as stored, and the audit store."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import Keys, ulid
from jobtier.core.model import decode_status
from jobtier.persist.audit_store import AuditRecord, AuditStore
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.persist.pg_reader import PgReader, _by_state, id_prefix_range, listing_sql
from tests.fixtures.postgres import generic_plan, mixed_workload


@pytest.fixture
async def persisted(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> list[str]:
    job_ids = await mixed_workload(redis, keys, n=150, seed=3)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    return job_ids


async def all_pages(reader: PgReader, **filters: Any) -> list[tuple[str, str]]:
    """(tenant, id) of every job the listing gives for ``filters``, page by page."""
    seen, cursor = [], None
    while True:
        page, cursor = await reader.admin_list_jobs(**filters, limit=7, cursor=cursor)
        seen += [(tenant, decode_status(doc).id) for tenant, doc in page]
        if cursor is None:
            return seen


async def test_the_listing_crosses_tenants_and_each_filter_keeps_its_jobs(
    persisted: list[str], pg_pool: Pool
) -> None:
    reader = PgReader(pg_pool)
    rows = await pg_pool.fetch("SELECT id, tenant, state, type, queue, created_at FROM jobs")
    assert {r["tenant"] for r in rows} == {"t1", "t2"}
    everything = await all_pages(reader)
    assert sorted(everything) == sorted((r["tenant"], r["id"]) for r in rows)
    assert len(everything) == len(set(everything)) == len(persisted)
    for column, value in (
        ("tenant", "t2"),
        ("state", "failed"),
        ("type", "mail"),
        ("queue", "default"),
    ):
        got = {job_id for _, job_id in await all_pages(reader, **{column: value})}
        assert got == {r["id"] for r in rows if r[column] == value}, column
    both = await all_pages(reader, tenant="t1", state="succeeded", type="echo")
    expected = [
        r for r in rows if (r["tenant"], r["state"], r["type"]) == ("t1", "succeeded", "echo")
    ]
    assert {j for _, j in both} == {r["id"] for r in expected}
    # a time range, on created_at: the middle third of the jobs
    times = sorted(r["created_at"] for r in rows)
    low, high = times[len(times) // 3], times[2 * len(times) // 3]
    ranged = {j for _, j in await all_pages(reader, created_after=low, created_before=high)}
    assert ranged == {r["id"] for r in rows if low < r["created_at"] < high}
    # an id prefix, in any case
    some = rows[0]["id"]
    for prefix in (some[:12], some[:12].lower(), some):
        got = {j for _, j in await all_pages(reader, id_prefix=prefix)}
        assert got == {r["id"] for r in rows if r["id"].startswith(prefix.upper())}
    assert await all_pages(reader, id_prefix="ZZZZ") == []


def test_an_id_prefix_is_a_range_in_byte_order() -> None:
    assert id_prefix_range("01hv3k") == ("01HV3K", "01HV3L")
    assert id_prefix_range("01HV3K9") == ("01HV3K9", "01HV3K:")
    assert id_prefix_range(f"{ulid()}-1")[1].endswith("-2")
    for bad in ("", "01HV!", "a b", "x" * 27, "01HV-1-2", "ü"):
        with pytest.raises(InvalidRequest):
            id_prefix_range(bad)


# The plans: with table scans, bitmap scans and sorts made dear (a test table is small
# enough for any plan to win), each filter is served by the index named, newest first
# without a sort (but an id prefix, whose few matches must be sorted), in the generic plan
# a prepared statement may switch to after five runs (planned without the values: a partial
# index serves only a filter whose SQL names its state); bench/console.py shows the same
# plans chosen freely on a million jobs.
PLANS = [
    ({}, "jobs_created_idx", False),
    ({"state": "failed"}, "jobs_by_state_state_idx", False),
    ({"type": "mail"}, "jobs_type_created_idx", False),
    ({"queue": "default"}, "jobs_queue_created_idx", False),
    ({"tenant": "t1"}, "jobs_tenant_created_idx", False),
    # two filters: either's index serves (the planner picks by the statistics)
    (
        {"tenant": "t1", "state": "failed"},
        "jobs_by_state_tenant_idx|jobs_by_state_state_idx",
        False,
    ),
    # a state jobs collect in, with a type or a queue: 0020's partial indexes
    ({"state": "failed", "type": "mail"}, "jobs_by_state_type_idx", False),
    ({"state": "cancelled", "queue": "default"}, "jobs_by_state_queue_idx", False),
    # succeeded, the state nearly every job ends in: filtered in created_at order
    ({"state": "succeeded"}, "jobs_created_idx", False),
    ({"tenant": "t1", "state": "succeeded"}, "jobs_tenant_created_idx", False),
    ({"created_after": datetime(2020, 1, 1, tzinfo=UTC)}, "jobs_created_idx", False),
    ({"id_prefix": "01HV3K"}, "jobs_id_prefix_idx", True),
]


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in nodes(child))]


@pytest.mark.parametrize(("filters", "index", "sorted_after"), PLANS)
async def test_each_filter_of_the_listing_has_an_index_that_serves_it(
    pg_pool: Pool, filters: dict[str, Any], index: str, sorted_after: bool
) -> None:
    sql, params = listing_sql(
        _by_state("admin_list_jobs", filters.get("state")), 50, "desc", **filters
    )
    # (a sort too, but where one is needed: then the index that finds the rows counts)
    dear = ("seqscan", "bitmapscan", *(() if sorted_after else ("sort",)))
    async with pg_pool.acquire() as conn:
        plan = await generic_plan(conn, sql, params, dear)
    used = {n.get("Index Name") for n in nodes(plan)}
    assert used & set(index.split("|")), (filters, used)
    assert not any(n["Node Type"] == "Seq Scan" for n in nodes(plan)), plan
    assert any(n["Node Type"] == "Sort" for n in nodes(plan)) is sorted_after, json.dumps(plan)


async def test_the_history_keeps_every_member_of_an_error(
    persisted: list[str], pg_pool: Pool
) -> None:
    reader = PgReader(pg_pool)
    failed = await pg_pool.fetchval("SELECT id FROM jobs WHERE state = 'failed' LIMIT 1")
    history = await reader.admin_history(failed)
    assert history[0].from_state is None and history[-1].to_state == "failed"
    # an error as a worker that sends a traceback stores it: the console gets all of it
    error = b'{"type":"E","message":"m","traceback":"Traceback ...","code":7}'
    await pg_pool.execute(
        "UPDATE job_transitions SET error = $2 WHERE job_id = $1 AND version = $3",
        failed, error, history[-1].version,
    )  # fmt: skip
    again = await reader.admin_history(failed)
    assert again[-1].error is not None and bytes(again[-1].error) == error
    assert await reader.admin_history(Keys().new_id()) == []


async def test_the_audit_store_pages_newest_first_and_a_record_is_written_once(
    pg_pool: Pool,
) -> None:
    store = AuditStore(pg_pool)
    start = datetime.now(UTC)
    records = [
        AuditRecord(
            id=ulid(int((start + timedelta(milliseconds=i)).timestamp() * 1000)),
            at=start + timedelta(milliseconds=i),
            actor="admin:0123456789ab",
            action="queue.pause" if i % 2 else "job.cancel",
            target=f"q{i % 3}",
            status=200,
            detail={"i": i},
            source="127.0.0.1",
        )
        for i in range(9)
    ]
    await store.insert(records)
    await store.insert(records[:3])  # sent again (deferred, then flushed twice): no new rows
    assert await pg_pool.fetchval("SELECT count(*) FROM audit") == 9
    first, cursor = await store.list(limit=4)
    rest, end = await store.list(limit=10, before=cursor)
    assert [r.id for r in first + rest] == [r.id for r in reversed(records)] and end is None
    assert first[0] == records[-1]
    assert [r.detail["i"] for r in (await store.list(target="q1"))[0]] == [7, 4, 1]
    assert {r.action for r in (await store.list(action="queue.pause"))[0]} == {"queue.pause"}
    with pytest.raises(InvalidRequest):
        await store.list(before="not-an-id")


def test_a_state_is_written_as_one_of_a_fixed_set_of_literals() -> None:
    sql, params = listing_sql("list_jobs_by_state", 50, "desc", tenant="t1", state="failed")
    assert "AND state = 'failed'" in sql and params == [51, "t1"]
    bad: list[Any] = ["failed' OR '1'='1", "FAILED", ["failed"], 7, "submitted"]
    for state in bad:  # (what a caller outside the type checker may pass)
        with pytest.raises(InvalidRequest, match="state must be one of"):
            listing_sql("admin_list_jobs", 50, "desc", state=state)


async def test_queued_jobs_of_a_rare_type_are_read_by_the_types_index(pg_pool: Pool) -> None:
    """Queued jobs are not in 0020's partial indexes: of a type with fewer jobs than are
    queued, the listing reads that type's jobs in `jobs`; of a common type, the queued rows of
    jobs_by_state; both give every job of the filter, newest first, page after page. No
    statistics yet: the way of every state."""
    reader = PgReader(pg_pool)
    reader.stats.ttl = 0.0  # read them at every listing
    rare = {"state": "queued", "type": "rare"}
    common = {"state": "queued", "type": "common"}
    assert await reader.listing_query("admin_list_jobs", **rare) == "list_jobs_by_state"
    insert = (
        "INSERT INTO jobs (id, tenant, type, priority, state, version, attempt, max_attempts,"
        " created_at, updated_at, doc, queue)"
        " SELECT id, 't' || (g % 3), $2::text, 'normal', $3::text, 1, 1, 1,"
        " now() - g * interval '1 second', now(), convert_to(json_build_object("
        " 'id', id, 'type', $2::text, 'state', $3::text, 'version', 1, 'priority', 'normal',"
        " 'attempt', 1, 'max_attempts', 1, 'created_at', '2026-01-01T00:00:00.000Z',"
        " 'updated_at', '2026-01-01T00:00:00.000Z')::text, 'UTF8'), 'default'"
        " FROM unnest($1::text[]) WITH ORDINALITY AS u(id, g)"
    )
    keys = Keys()
    for kind, state, n in (
        ("common", "queued", 400), ("common", "succeeded", 100), ("rare", "queued", 20),
        ("rare", "failed", 3),
    ):  # fmt: skip
        await pg_pool.execute(insert, [keys.new_id() for _ in range(n)], kind, state)
    await pg_pool.execute("ANALYZE jobs")
    await pg_pool.execute("ANALYZE jobs_by_state")
    assert await reader.listing_query("admin_list_jobs", **rare) == "admin_list_jobs"
    assert await reader.listing_query("list_jobs", tenant="t1", **rare) == "list_jobs"
    assert await reader.listing_query("admin_list_jobs", **common) == "list_jobs_by_state"
    # a state the partial indexes hold, or no type or queue: through jobs_by_state
    for other in ({"state": "failed", "type": "rare"}, {"state": "queued"}):
        assert await reader.listing_query("admin_list_jobs", **other) == "list_jobs_by_state"
    rows = await pg_pool.fetch("SELECT id, tenant, state, type, created_at FROM jobs")
    for where in (rare, common):
        for tenant in (None, "t1"):
            expected = [
                r["id"]
                for r in sorted(rows, key=lambda r: (r["created_at"], r["id"]), reverse=True)
                if (r["state"], r["type"]) == (where["state"], where["type"])
                and tenant in (None, r["tenant"])
            ]
            if tenant is None:
                listed = [job_id for _, job_id in await all_pages(reader, **where)]
            else:
                listed = await _tenant_pages(reader, tenant, where)
            assert listed == expected, (where, tenant)
    with pytest.raises(InvalidRequest, match="type"):  # checked as before, whatever the way
        await reader.admin_list_jobs(state="queued", type=["rare"])  # type: ignore[arg-type]


async def _tenant_pages(reader: PgReader, tenant: str, where: dict[str, Any]) -> list[str]:
    """The ids of every page of a tenant's listing (``PgReader.list_jobs``), 7 a page."""
    seen, cursor = [], None
    while True:
        page, cursor = await reader.list_jobs(tenant, **where, limit=7, cursor=cursor)
        seen += [job.id for job in page]
        if cursor is None:
            return seen
