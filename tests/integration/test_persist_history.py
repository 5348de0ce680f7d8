"""Progress reports are coalesced in the history, and the history still proves itself complete.

The real Lua scripts on a real Redis, the persister into a real Postgres.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.persist.db import Pool, query
from jobtier.persist.persister import Persister
from jobtier.status.docs import read_doc
from jobtier.store import format as job_format
from jobtier.store.calls import (
    SubmitItem,
    complete_call,
    fail_call,
    heartbeat_call,
    promote_call,
    stopped_call,
    submit_call,
)
from jobtier.store.scripts import Scripts
from jobtier.store.subscriber import ShardSubscriber
from jobtier.streams.entries import split_fields
from tests.fixtures.engine import wait_for
from tests.fixtures.postgres import log_entries

HOUR_MS = 3_600_000


async def running_job(scripts: Scripts, keys: Keys) -> tuple[str, int]:
    """A job submitted and claimed on shard 0: (id, lease version)."""
    job_id = keys.new_id(0)
    item = SubmitItem(job_id, "t1", "sleep", "normal", b"{}", 1, 0, 0, "", "h")
    await scripts.call(*submit_call(0, [item], 60_000))
    batch = await scripts.claim(0, "w1", 1, 60_000)
    assert [j.id for j in batch.jobs] == [job_id]
    return job_id, batch.jobs[0].lease_version


async def report(scripts: Scripts, job_id: str, lv: int, progress: int, every_ms: int) -> None:
    call = heartbeat_call(0, "w1", 60_000, [(job_id, lv, b'{"pct":%d}' % progress)], every_ms)
    code, _cancel_requested = await scripts.call(*call)
    assert code == 0


async def logged(redis: Any, keys: Keys, job_id: str) -> list[tuple[int, int]]:
    """(version, pv) of the job's log entries."""
    out = []
    for _, _, whole in await log_entries(redis, keys):
        for fields in split_fields(whole):  # (a call's transitions are one entry)
            if job_id.encode() not in fields[b"d"][:80]:
                continue
            version = int(fields[b"d"].split(b'"version":', 1)[1].split(b",", 1)[0])
            out.append((version, int(fields[b"pv"])))
    return out


async def history(pool: Pool, job_id: str) -> list[tuple[int, int | None, str, Any]]:
    rows = await pool.fetch(
        "SELECT version, prev_version, to_state, progress::text FROM job_transitions"
        " WHERE job_id = $1 ORDER BY version",
        job_id,
    )
    return [tuple(r) for r in rows]


async def test_progress_is_coalesced_in_the_log_and_every_report_still_changes_the_status(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    scripts = Scripts(redis_as_jobtier, keys)
    job_id, lv = await running_job(scripts, keys)  # versions 1 (submit), 2 (claim)
    published: list[int] = []  # versions, from the status events every change publishes
    events = ShardSubscriber(
        redis_as_jobtier,
        [keys.events(0)],
        lambda _, data: published.append(int(data.split(b" ", 2)[1])),
    )
    await events.start()
    try:
        versions = []
        for pct in range(5):  # the claim was logged just now: none of these is
            await report(scripts, job_id, lv, pct, HOUR_MS)
            held = await redis.hmget(keys.job(job_id), job_format.small_fields("version"))
            versions.append(int(job_format.small_field(held, "version") or 0))
        assert versions == [3, 4, 5, 6, 7]  # each is a new status document (ETag)
        _, doc = await read_doc(redis, keys, job_id)
        assert b'"progress":{"pct":4}' in doc
        await scripts.cancel(0, "", job_id, 3600)  # 8: a cancel request is always logged
        await report(scripts, job_id, lv, 99, HOUR_MS)  # 9: not logged
        done = complete_call(0, "w1", 3600, [(job_id, lv, b"1")])
        await scripts.call(*done)  # 10: logged, carrying the last progress

        async def all_published() -> bool:
            return len(published) >= 8

        await wait_for(all_published)  # event streams (SSE, long polls) see every change
        assert published == [3, 4, 5, 6, 7, 8, 9, 10]
    finally:
        await events.stop()

    assert await logged(redis, keys, job_id) == [(1, 0), (2, 1), (8, 2), (10, 8)]
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    assert await history(pg_pool, job_id) == [
        (1, 0, "queued", None),
        (2, 1, "running", None),
        (8, 2, "running", '{"pct":4}'),
        (10, 8, "succeeded", '{"pct":99}'),
    ]
    row = await pg_pool.fetchrow("SELECT version, progress::text FROM jobs WHERE id = $1", job_id)
    assert row is not None
    assert tuple(row) == (10, '{"pct":99}')
    assert await pg_pool.fetch(query("history_gaps"), [job_id]) == []


async def test_every_report_is_logged_with_zero_and_after_the_interval(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    scripts = Scripts(redis_as_jobtier, keys)
    job_id, lv = await running_job(scripts, keys)
    await report(scripts, job_id, lv, 1, 0)  # 3: interval 0 logs every report
    await report(scripts, job_id, lv, 2, 0)  # 4
    await report(scripts, job_id, lv, 3, HOUR_MS)  # 5: 4 was logged just now: not logged
    await asyncio.sleep(0.01)  # Redis's clock moves past a 1 ms interval
    await report(scripts, job_id, lv, 4, 1)  # 6: the last logged entry (4) is older: logged
    assert await logged(redis, keys, job_id) == [(1, 0), (2, 1), (3, 2), (4, 3), (6, 4)]


async def test_history_gaps_finds_a_missing_row(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    scripts = Scripts(redis_as_jobtier, keys)
    job_id, lv = await running_job(scripts, keys)
    await scripts.cancel(0, "", job_id, 3600)  # 3
    await report(scripts, job_id, lv, 5, HOUR_MS)  # 4, not logged
    await scripts.call(*complete_call(0, "w1", 3600, [(job_id, lv, b"1")]))  # 5 -> 3
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    gaps = query("history_gaps")
    unknown = "01ARZ3NDEKTSV4RRFFQ69G5FAV-0"
    assert [tuple(r) for r in await pg_pool.fetch(gaps, [job_id, unknown])] == [
        (unknown, None, None)
    ]
    await pg_pool.execute("DELETE FROM job_transitions WHERE job_id = $1 AND version = 3", job_id)
    assert [tuple(r) for r in await pg_pool.fetch(gaps, [job_id])] == [(job_id, 3, 5)]
    await pg_pool.execute("DELETE FROM job_transitions WHERE job_id = $1 AND version = 5", job_id)
    assert [tuple(r) for r in await pg_pool.fetch(gaps, [job_id])] == [(job_id, 5, None)]


async def test_an_error_is_on_the_transition_that_failed_only(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """The document keeps an attempt's error until the next one fails; the history shows it on
    the failure's row alone: not on the promotion, the claims, a release by a stopping worker
    nor the success that follow."""
    scripts = Scripts(redis_as_jobtier, keys)
    job_id = keys.new_id(0)
    item = SubmitItem(job_id, "t1", "sleep", "normal", b"{}", 3, 0, 0, "", "h")
    await scripts.call(*submit_call(0, [item], 60_000))  # 1 queued

    async def claimed() -> int:
        batch = await scripts.claim(0, "w1", 1, 60_000)
        assert [j.id for j in batch.jobs] == [job_id]
        return batch.jobs[0].lease_version

    lv = await claimed()  # 2 running
    boom = b'{"type":"ValueError","message":"boom"}'
    await scripts.call(*fail_call(0, "w1", 3600, [(job_id, lv, boom, 0)]))  # 3 scheduled

    async def promoted() -> bool:  # run_at is now: due once Redis's clock reaches it
        await scripts.call(*promote_call(0, 10))
        return await redis.zscore(keys.base(0) + "sched", job_id) is None

    await wait_for(promoted)  # 4 queued
    lv = await claimed()  # 5 running
    await scripts.call(*stopped_call(0, "w1", 3600, [(job_id, lv)]))  # 6 queued, released
    lv = await claimed()  # 7 running
    await scripts.call(*complete_call(0, "w1", 3600, [(job_id, lv, b"1")]))  # 8 succeeded
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()

    rows = await pg_pool.fetch(
        "SELECT from_state, to_state, error->>'message' AS error FROM job_transitions"
        " WHERE job_id = $1 ORDER BY version",
        job_id,
    )
    assert [(r["from_state"], r["to_state"], r["error"]) for r in rows] == [
        (None, "queued", None),
        ("queued", "running", None),
        ("running", "scheduled", "boom"),
        ("scheduled", "queued", None),
        ("queued", "running", None),
        ("running", "queued", None),
        ("queued", "running", None),
        ("running", "succeeded", None),
    ]
    # the status document still tells the last failure, as it did
    _, doc = await read_doc(redis, keys, job_id)
    assert b'"message":"boom"' in doc
