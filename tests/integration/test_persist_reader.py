"""Reads of the durable record: status fallback, listing, history, results, bad input."""

from __future__ import annotations

import base64
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest

from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import Keys
from jobtier.core.model import State, Transition, decode_status
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.persist.pg_reader import PgReader, decode_cursor, encode_cursor
from jobtier.status.docs import read_doc
from jobtier.store.calls import SubmitItem, complete_call, submit_call
from jobtier.store.scripts import Scripts
from tests.fixtures.postgres import LARGE_RESULT, RETENTION, mixed_workload


@pytest.fixture
async def persisted(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> list[str]:
    job_ids = await mixed_workload(redis, keys, n=120, seed=1)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    return job_ids


async def test_status_doc_is_what_redis_served(
    persisted: list[str], redis: Any, pg_pool: Pool, keys: Keys
) -> None:
    reader = PgReader(pg_pool)
    for job_id in persisted[:20]:
        tenant, doc = await reader.status_doc(job_id) or ("", b"")
        assert doc == (await read_doc(redis, keys, job_id))[1]
        assert tenant == (await redis.hget(keys.job(job_id), "tenant")).decode()
    assert await reader.status_doc(keys.new_id(0)) is None


async def test_listing_pages_through_every_job_of_the_tenant_once(
    persisted: list[str], pg_pool: Pool
) -> None:
    reader = PgReader(pg_pool)
    expected = {r["id"] for r in await pg_pool.fetch("SELECT id FROM jobs WHERE tenant = 't1'")}
    for order in ("desc", "asc"):
        seen: list[Any] = []
        cursor = None
        while True:
            page, cursor = await reader.list_jobs("t1", cursor=cursor, limit=7, order=order)
            seen += page
            if cursor is None:
                break
        assert {j.id for j in seen} == expected
        assert len(seen) == len(expected)
        keys_ = [(j.created_at, j.id) for j in seen]
        assert keys_ == sorted(keys_, reverse=order == "desc")


async def test_listing_filters(persisted: list[str], pg_pool: Pool) -> None:
    reader = PgReader(pg_pool)
    page, cursor = await reader.list_jobs("t2", state="succeeded", limit=500)
    assert page and cursor is None
    assert all(j.state is State.SUCCEEDED for j in page)
    count = await pg_pool.fetchval(
        "SELECT count(*) FROM jobs WHERE tenant = 't2' AND state = 'succeeded'"
    )
    assert len(page) == count

    page, _ = await reader.list_jobs("t1", type="mail", state="failed", limit=500)
    assert all(j.type == "mail" and j.state is State.FAILED for j in page)

    everything, _ = await reader.list_jobs("t1", limit=500, order="asc")
    # the workload's jobs may all share one creation millisecond (one script call per shard):
    # a threshold before all, one at the last, and one between when there is a between
    times = sorted({j.created_at for j in everything})
    thresholds = ["2000-01-01T00:00:00.000Z", times[-1], *times[:-1]]  # ISO dates sort
    for threshold in thresholds:
        later, _ = await reader.list_jobs("t1", created_after=threshold, limit=500)
        assert all(j.created_at > threshold for j in later)
        assert len(later) == sum(j.created_at > threshold for j in everything)
    assert len((await reader.list_jobs("t1", created_after=thresholds[0], limit=500))[0]) == len(
        everything
    )

    assert await reader.list_jobs("nobody") == ([], None)


def records_error(before: Transition, t: Transition) -> bool:
    """A failure (to failed, or back for a retry or an expired lease) or a cancel; not a
    release by a stopping worker (running -> queued, its attempt given back)."""
    if t.to_state in (State.FAILED, State.CANCELLED):
        return True
    released = t.to_state is State.QUEUED and t.attempt < before.attempt
    back = t.to_state in (State.SCHEDULED, State.QUEUED)
    return t.from_state is State.RUNNING and back and not released


async def test_history_lists_every_version(
    persisted: list[str], redis: Any, pg_pool: Pool, keys: Keys
) -> None:
    reader = PgReader(pg_pool)
    for job_id in persisted[:30]:
        tenant = (await redis.hget(keys.job(job_id), "tenant")).decode()
        history = await reader.history(job_id, tenant)
        assert history is not None
        status = decode_status((await read_doc(redis, keys, job_id))[1])
        assert [t.version for t in history] == list(range(1, status.version + 1))
        assert history[0].from_state is None and history[0].worker == "api"
        assert history[-1].to_state is status.state
        # an error on the transitions that record one only, the last one's the job's own
        for before, t in itertools.pairwise(history):
            assert (t.error is not None) == records_error(before, t), (job_id, t)
        assert history[-1].error in (None, status.error)
        assert history[-1].progress == status.progress
        # another tenant's job is unknown, exactly like a missing one
        assert await reader.history(job_id, "someone-else") is None
        msgspec.json.encode(history)  # the API can serialise it as it is
    assert await reader.history(keys.new_id(1), "t1") is None


async def test_results_inline_large_null_and_unfinished(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    scripts = Scripts(redis, keys)
    ids = [keys.new_id(0) for _ in range(4)]
    items = [SubmitItem(i, "t1", "echo", "normal", b"{}", 1, 0, 0, "", "") for i in ids]
    await scripts.call(*submit_call(0, items, 60_000))
    batch = await scripts.claim(0, "w", 3, 60_000)
    results = {ids[0]: b'{"small":true}', ids[1]: LARGE_RESULT, ids[2]: b""}
    done = [(j.id, j.lease_version, results[j.id]) for j in batch.jobs]
    await scripts.call(*complete_call(0, "w", RETENTION, done))
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()

    reader = PgReader(pg_pool)
    small, large, null, waiting = [await reader.result(i, "t1") for i in ids]
    assert small is not None and small.result == b'{"small":true}'
    assert large is not None and large.result == LARGE_RESULT
    assert await pg_pool.fetchval("SELECT result FROM jobs WHERE id = $1", ids[1]) is None
    assert null is not None and null.result == b"null" and null.state is State.SUCCEEDED
    assert waiting is not None and waiting.result is None and waiting.state is State.QUEUED
    assert await reader.result(ids[0], "t2") is None


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 501},
        {"limit": "10"},
        {"limit": True},
        {"state": "done"},
        {"type": ""},
        {"order": "sideways"},
        {"created_after": "yesterday"},
        {"cursor": "not a cursor"},
        {"cursor": base64.urlsafe_b64encode(b"desc:12:not-an-id").decode()},
        {"cursor": base64.urlsafe_b64encode(b"desc:-5:01ARZ3NDEKTSV4RRFFQ69G5FAV-1").decode()},
        {"cursor": encode_cursor("asc", datetime.now(UTC), "01ARZ3NDEKTSV4RRFFQ69G5FAV-1")},
        {"cursor": "€"},
    ],
)
async def test_bad_listing_parameters_are_invalid_requests(
    pg_pool: Pool, params: dict[str, Any]
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await PgReader(pg_pool).list_jobs("t1", **params)
    assert caught.value.field in params


def test_cursor_round_trip() -> None:
    at = datetime(2024, 5, 1, 12, 0, 0, 123000, tzinfo=UTC)
    job_id = "01ARZ3NDEKTSV4RRFFQ69G5FAV-3"
    assert decode_cursor(encode_cursor("desc", at, job_id), "desc") == (at, job_id)
    later = at + timedelta(microseconds=1)
    assert decode_cursor(encode_cursor("asc", later, job_id), "asc")[0] == later
