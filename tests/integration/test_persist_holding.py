"""Live jobs' rows held back by the persister (persist/holding.py), against real Redis and
Postgres: a claim's row waits for the job's end and is never written, a hold that runs out
writes it, and a persister that dies or stops holding rows loses none of them."""

from __future__ import annotations

import asyncio
from typing import Any

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import ClaimedJob
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.store.calls import (
    SubmitItem,
    claim_call,
    complete_call,
    fail_call,
    parse_claim,
    submit_call,
)
from jobtier.store.scripts import Scripts
from jobtier.streams.entries import split_fields
from jobtier.streams.group import lag
from tests.fixtures.engine import running, wait_for
from tests.fixtures.postgres import assert_pg_matches_redis

N = 6


def holding(settings: Settings, seconds: float) -> Settings:
    # the hold is capped at half the claim idle time: leave it room
    return settings.replace(persist_hold_seconds=seconds, persist_claim_idle_seconds=600)


async def submitted_and_claimed(
    redis: Any, keys: Keys, persister: Persister
) -> tuple[list[str], list[ClaimedJob]]:
    """N jobs submitted, their rows written (``drain``), then claimed: (ids, claims)."""
    scripts = Scripts(redis, keys)
    items = [
        SubmitItem(keys.new_id(0), "t1", "echo", "normal", b'{"n":%d}' % i, 3, 0, 0, "", "")
        for i in range(N)
    ]
    await scripts.call_many([submit_call(0, items, 60_000)])
    assert await persister.drain() == N
    [reply] = await scripts.call_many([claim_call(0, "w1", N, 60_000)])
    return [i.job_id for i in items], parse_claim(0, reply).jobs


async def complete(redis: Any, keys: Keys, claims: list[ClaimedJob]) -> None:
    done = [(j.id, j.lease_version, b'{"ok":true}') for j in claims]
    await Scripts(redis, keys).call_many([complete_call(0, "w1", 3600, done)])


async def states(pool: Pool) -> list[str]:
    return [r[0] for r in await pool.fetch("SELECT state FROM jobs ORDER BY id")]


async def sorted_states(pool: Pool) -> list[str]:
    return sorted(await states(pool))


async def history(pool: Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM job_transitions"))


async def test_a_claims_row_waits_for_the_jobs_end_and_is_never_written(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    persister = Persister(holding(pg_settings, 60), redis_as_jobtier, pg_pool, "p1")
    ids, claims = await submitted_and_claimed(redis, keys, persister)
    async with running(persister):
        # the claims' history rows are written; their job rows wait, and so do their entries
        await wait_for(lambda: _equals(history(pg_pool), 2 * N), 60)
        assert await states(pg_pool) == ["queued"] * N
        assert (await lag(redis, keys))[0] == N
        await complete(redis, keys, claims)
        await wait_for(lambda: _equals(lag(redis, keys), (0, 0.0)), 60)
    assert await states(pg_pool) == ["succeeded"] * N
    assert await pg_pool.fetchval("SELECT count(*) FROM jobs_by_state") == 0
    await assert_pg_matches_redis(redis, pg_pool, keys, ids)  # every history row, in order
    # each job's row written twice, at its submit and at its end: its claim took no write
    assert persister.holding.collapsed == N and persister.stats.jobs == 2 * N
    assert persister.metrics().counters["persister_rows_collapsed_total"] == {"": N}


async def test_a_row_whose_hold_runs_out_is_written(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    persister = Persister(holding(pg_settings, 0.3), redis_as_jobtier, pg_pool, "p1")
    ids, _ = await submitted_and_claimed(redis, keys, persister)
    async with running(persister):
        await wait_for(lambda: _equals(states(pg_pool), ["running"] * N), 60)
        await wait_for(lambda: _equals(lag(redis, keys), (0, 0.0)), 60)
    await assert_pg_matches_redis(redis, pg_pool, keys, ids)
    assert persister.holding.collapsed == 0 and len(persister.holding) == 0
    assert persister._taken == set()  # every entry acknowledged: none kept from a read


async def test_a_persister_that_dies_holding_rows_leaves_their_entries_to_the_next(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    settings = holding(pg_settings, 60)
    persister = Persister(settings, redis_as_jobtier, pg_pool, "p1")
    ids, _ = await submitted_and_claimed(redis, keys, persister)
    task = asyncio.create_task(persister.run())
    await wait_for(lambda: _equals(history(pg_pool), 2 * N), 60)
    task.cancel()  # dies: no final flush, nothing acknowledged
    await asyncio.gather(task, return_exceptions=True)
    assert await states(pg_pool) == ["queued"] * N
    assert (await lag(redis, keys))[0] == N
    # restarted under its name, it reads back its pending entries: their history rows are
    # there already (a replay changes nothing), their job rows are written now
    again = Persister(settings, redis_as_jobtier, pg_pool, "p1")
    assert await again.drain() == N
    assert await states(pg_pool) == ["running"] * N
    assert await history(pg_pool) == 2 * N
    assert await lag(redis, keys) == (0, 0.0)
    await assert_pg_matches_redis(redis, pg_pool, keys, ids)


async def test_a_persister_stopping_writes_the_rows_it_holds(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    persister = Persister(holding(pg_settings, 60), redis_as_jobtier, pg_pool, "p1")
    ids, _ = await submitted_and_claimed(redis, keys, persister)
    async with running(persister):
        await wait_for(lambda: _equals(history(pg_pool), 2 * N), 60)
        assert len(persister.holding) == N
    assert await states(pg_pool) == ["running"] * N
    assert await lag(redis, keys) == (0, 0.0)
    assert persister._taken == set()
    await assert_pg_matches_redis(redis, pg_pool, keys, ids)


async def test_a_batch_refused_for_its_data_writes_the_rows_it_would_hold_in_parts(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """A batch Postgres refuses for one entry's data is written again in parts (halves, down
    to the bad entry alone): the entries of the rows it would hold, and of the holds they
    joined, go with it, with their rows, and nothing stays held."""
    persister = Persister(holding(pg_settings, 60), redis_as_jobtier, pg_pool, "p1")
    ids, claims = await submitted_and_claimed(redis, keys, persister)

    async def stepped(done: Any) -> bool:
        await persister.step()
        return bool(await done())

    async def claims_held() -> bool:
        return len(persister.holding) == N and not persister._inflight

    await wait_for(lambda: stepped(claims_held), 60)
    assert await states(pg_pool) == ["queued"] * N and await history(pg_pool) == 2 * N
    # each job fails, to be retried (a row that would be held again), and a submit whose
    # payload Postgres refuses comes in the same batch
    err = b'{"type":"Boom","message":"try again"}'
    failed = [(j.id, j.lease_version, err, 0) for j in claims]
    await Scripts(redis, keys).call_many([fail_call(0, "w1", 3600, failed)])
    one = SubmitItem(keys.new_id(0), "t1", "echo", "normal", b"{}", 3, 0, 0, "", "")
    await Scripts(redis, keys).call_many([submit_call(0, [one], 60_000)])
    [(_, submitted)] = await redis.xrevrange(keys.log(0), count=1)  # its submit entry
    ids.append(one.job_id)
    bad = {**submitted, b"p": b"{not json"}
    bad[b"d"] = bad[b"d"].replace(b'"id":"', b'"id":"X', 1)  # another job
    await redis.xadd(keys.log(0), bad)

    async def refused() -> bool:
        return persister.stats.parked == 1 and not persister._inflight

    await wait_for(lambda: stepped(refused), 60)
    # written in parts at once: nothing held (the hold is a minute), nothing pending
    assert len(persister.holding) == 0 and await lag(redis, keys) == (0, 0.0)
    assert persister._taken == set()  # the parked entry too
    assert sorted(await states(pg_pool)) == ["queued"] + ["scheduled"] * N
    await assert_pg_matches_redis(redis, pg_pool, keys, ids)


async def test_an_entry_stays_pending_while_a_row_of_one_of_its_transitions_is_held(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """An entry holds one script call's transitions: while a row of one of them is held, the
    entry stays pending, though its others are written (a persister that died meanwhile
    leaves it to the next), and it is acknowledged once that row is written too."""
    persister = Persister(holding(pg_settings, 60), redis_as_jobtier, pg_pool, "p1")
    ids, claims = await submitted_and_claimed(redis, keys, persister)
    await complete(redis, keys, claims[:3])
    # one entry of the claims of N jobs and the successes of 3 of them (a call may mix them)
    (claimed_id, claimed), (done_id, done) = await redis.xrange(keys.log(0))
    parts = split_fields(claimed) + split_fields(done)
    entry = {b"n": b"%d" % len(parts)}
    for place, part in enumerate(parts, 1):
        entry.update({name + b"%d" % place: value for name, value in part.items()})
    await redis.xdel(keys.log(0), claimed_id, done_id)
    await redis.xadd(keys.log(0), entry)
    async with running(persister):
        # the 3 ended jobs' rows are written; the others' wait, and so does the entry
        await wait_for(
            lambda: _equals(sorted_states(pg_pool), ["queued"] * 3 + ["succeeded"] * 3), 60
        )
        await wait_for(lambda: _equals(history(pg_pool), 2 * N + 3), 60)
        assert len(persister.holding) == N - 3
        assert (await lag(redis, keys))[0] == N + 3
    # stopping writes the held rows: the entry is acknowledged then
    assert sorted(await states(pg_pool)) == ["running"] * 3 + ["succeeded"] * 3
    assert await lag(redis, keys) == (0, 0.0)
    await assert_pg_matches_redis(redis, pg_pool, keys, ids)


async def _equals(value: Any, expected: Any) -> bool:
    return bool(await value == expected)
