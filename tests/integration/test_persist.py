"""The persister against real Redis and Postgres: exactness, idempotence, crash recovery."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import signal
import time
from collections.abc import Sequence
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.dev.local_redis import LocalRedis
from jobtier.persist import batch as batch_module
from jobtier.persist import persister as persister_module
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.store.redis import connect
from jobtier.streams.entries import LogEntry, parse_entries
from jobtier.streams.group import lag, lag_key, oldest_waiting, replay_refused, shared_lag
from tests.fixtures.engine import wait_for
from tests.fixtures.postgres import (
    assert_pg_matches_redis,
    log_entries,
    mixed_workload,
    simple_jobs,
)
from tests.fixtures.redis import logged


async def snapshot(pool: Pool) -> tuple[list[Any], ...]:
    jobs = await pool.fetch("SELECT *, payload::text, result::text FROM jobs ORDER BY id")
    history = await pool.fetch(
        "SELECT *, error::text, progress::text FROM job_transitions ORDER BY job_id, version"
    )
    results = await pool.fetch("SELECT job_id, result::text, size FROM job_results ORDER BY 1")
    listed = await pool.fetch("SELECT * FROM jobs_by_state ORDER BY id")
    return tuple([tuple(r) for r in rows] for rows in (jobs, history, results, listed))


async def transition_fields(redis: Any, keys: Keys) -> list[dict[bytes, bytes]]:
    """Every transition in the shard logs, as the fields of an entry of one."""
    return [p for s in range(keys.shards) for p in await logged(redis, keys.log(s))]


def parsed(raw: Sequence[tuple[int, bytes, dict[bytes, bytes]]]) -> list[LogEntry]:
    return [e for shard, entry_id, fields in raw for e in parse_entries(shard, entry_id, fields)]


async def test_mixed_workload_reaches_postgres_exactly(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    job_ids = await mixed_workload(redis, keys, n=150)
    entries = await log_entries(redis, keys)
    transitions = parsed(entries)  # a script's transitions are one entry
    assert len(entries) < len(transitions)
    assert (await lag(redis, keys, exact=len(entries)))[0] == len(transitions)

    persister = Persister(
        pg_settings.replace(persist_batch_size=64), redis_as_jobtier, pg_pool, "p1"
    )
    assert await persister.drain() == len(transitions)

    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert persister.stats.batches > 1
    assert await lag(redis, keys) == (0, 0.0)
    # everything was acknowledged, so everything was trimmed
    assert sum([await redis.xlen(keys.log(s)) for s in range(keys.shards)]) == 0


async def test_batch_metrics_tell_how_old_transitions_were_and_how_long_writes_took(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    async def redis_now() -> float:
        seconds, micros = await redis.time()
        return float(seconds) + float(micros) / 1e6

    # two sets of transitions GAP apart, all at least AGED old when the persister reads them
    # (Redis's clock, which gives the log entries their ids, moving on: an event, not a
    # fixed sleep), written in one batch
    gap, aged = 0.2, 0.05
    start = await redis_now()
    await simple_jobs(redis, keys, 20)
    first_made = await redis_now()
    await wait_for(lambda: _later_than(redis_now, first_made + gap))
    await mixed_workload(redis, keys, n=100)
    made = await redis_now()
    await wait_for(lambda: _later_than(redis_now, made + aged))
    persister = Persister(
        pg_settings.replace(persist_batch_size=100_000), redis_as_jobtier, pg_pool, "p1"
    )
    began = time.time()
    await persister.drain()
    ended = time.time()

    histograms = persister.metrics().histograms
    waits = histograms["persister_batch_wait_seconds"][""]
    writes = histograms["persister_batch_write_seconds"][""]
    assert persister.stats.batches == waits["count"] == writes["count"] == 1
    # its oldest transition (of the first set) had waited the gap and more when the write
    # began, and no longer than the test; the newest ones only about `aged`
    assert gap + aged <= waits["sum"] <= ended - start
    assert 0 < writes["sum"] <= ended - began


async def _later_than(now: Any, moment: float) -> bool:
    return bool(await now() >= moment)


async def test_replaying_the_same_entries_changes_nothing(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    await mixed_workload(redis, keys, n=80, seed=3)
    entries = parsed(await log_entries(redis, keys))
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    await persister.drain()
    before = await snapshot(pg_pool)

    await persister.persist(entries)
    await persister.persist(entries[::-1])
    for entry in entries[:50]:
        await persister.persist([entry])
    assert await snapshot(pg_pool) == before


async def test_versions_committed_out_of_order_end_in_the_right_state(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """Several persisters commit a job's versions in any order: the latest state still wins,
    and the submit-only fields (payload, idempotency key) arrive whenever version 1 does."""
    job_ids = await mixed_workload(redis, keys, n=80, seed=5)
    entries = parsed(await log_entries(redis, keys))
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")

    # newest versions first, one transaction per version number
    for version in sorted({e.status.version for e in entries}, reverse=True):
        await persister.persist([e for e in entries if e.status.version == version])
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)


async def test_random_batches_in_random_order(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    job_ids = await mixed_workload(redis, keys, n=80, seed=11)
    entries = parsed(await log_entries(redis, keys))
    rng = random.Random(2)
    rng.shuffle(entries)
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    batches = [entries[i : i + 17] for i in range(0, len(entries), 17)]
    # and concurrently, as several persisters would (rows are locked in id order: no deadlock)
    await asyncio.gather(*(persister.persist(b) for b in batches))
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)


class Crash(Exception):
    pass


async def test_crash_between_commit_and_ack_is_replayed_without_doubles(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    job_ids = await simple_jobs(redis, keys, 200)

    class Doomed(Persister):
        async def _ack(self) -> None:
            if self.consumer.acks:
                raise Crash  # committed, and the process dies before acknowledging

    doomed = Doomed(pg_settings, redis_as_jobtier, pg_pool, "p1")
    with pytest.raises(Crash):
        await doomed.drain()
    assert (await lag(redis, keys))[0] == 600  # nothing acknowledged

    # the same name after a restart reads its own pending entries back first
    reborn = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    assert await reborn.drain() == 600
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert await lag(redis, keys) == (0, 0.0)


async def test_entries_of_a_dead_persister_are_claimed_after_the_idle_timeout(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    job_ids = await simple_jobs(redis, keys, 100)
    group = keys.persist_group()
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "setup").consumer.setup()
    for shard in range(keys.shards):  # a persister read these (submits, claims), then died
        await redis.xreadgroup(group, "dead", {keys.log(shard): ">"}, count=2)

    patient = Persister(pg_settings, redis_as_jobtier, pg_pool, "p2")  # claim idle timeout: 30 s
    await patient.drain()
    pending = sum([(await redis.xpending(keys.log(s), group))["pending"] for s in range(4)])
    assert pending == 8  # 2 entries a shard, of 25 transitions each
    # trimming kept every entry still pending
    assert sum([await redis.xlen(keys.log(s)) for s in range(keys.shards)]) >= 8

    quick = Persister(
        pg_settings.replace(persist_claim_idle_seconds=0.01), redis_as_jobtier, pg_pool, "p3"
    )

    async def idle_long_enough() -> bool:  # as Redis counts it, which XAUTOCLAIM goes by
        for shard in range(keys.shards):
            entries = await redis.xpending_range(keys.log(shard), group, "-", "+", 100)
            if any(e["time_since_delivered"] <= 10 for e in entries):
                return False
        return True

    await wait_for(idle_long_enough)
    assert await quick.drain() == 200
    assert quick.stats.claimed == 8
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert await lag(redis, keys) == (0, 0.0)
    assert sum([await redis.xlen(keys.log(s)) for s in range(keys.shards)]) == 0


async def test_run_persists_until_stopped(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    task = asyncio.create_task(persister.run())
    job_ids: list[str] = []
    for _ in range(5):
        job_ids += await simple_jobs(redis, keys, 50)
        await asyncio.sleep(0.01)
    await _until(lambda: persister.stats.transitions >= len(job_ids) * 3)
    persister.stop()
    await asyncio.wait_for(task, 10)
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert (await lag(redis, keys))[0] == 0


async def test_an_idle_persister_waits_in_redis_for_the_next_entry(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """With nothing to read, a persister is blocked in one XREADGROUP naming every stream
    (not napping between polls), and what comes meanwhile is written."""
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    task = asyncio.create_task(persister.run())
    try:
        await wait_for(lambda: _blocked_reading(redis))
        job_ids = await simple_jobs(redis, keys, 20)
        await _until(lambda: persister.stats.transitions >= len(job_ids) * 3)
    finally:
        persister.stop()
        await asyncio.wait_for(task, 10)
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert persister.stats.errors == {}


async def test_a_persister_waiting_in_redis_outlives_a_flush_and_a_sigkill(
    pg_settings: Settings, pg_pool: Pool, redis_to_kill: LocalRedis
) -> None:
    """Redis flushed while the persister waits in it (the wait is answered with an error:
    the stream is gone), then SIGKILLed under it (no shutdown, no final AOF write) with
    transitions it has not written yet, and started again from its AOF on the same port and
    data: each error is counted and retried as any Redis failure is (a lost connection is
    retried by the client itself), the consumer group made again, and every transition made
    before the kill and after the restart is written. A
    Redis of the test's own (``redis_to_kill``: every write in its AOF before its reply)."""
    settings = pg_settings.replace(redis_url=redis_to_kill.url)
    keys = Keys(settings.prefix, settings.shards)
    redis = connect(settings)
    persister = Persister(settings, redis, pg_pool, "p1")
    task = asyncio.create_task(persister.run())
    try:
        await wait_for(lambda: _blocked_reading(redis))
        await redis.flushall()
        await wait_for(lambda: persister.stats.errors.get("ResponseError", 0) >= 1)
        await wait_for(lambda: _blocked_reading(redis))  # back to waiting, the group made
        job_ids = await simple_jobs(redis, keys, 20)
        await _until(lambda: persister.stats.transitions >= len(job_ids) * 3)
        await wait_for(lambda: _blocked_reading(redis))  # waiting in Redis when it dies
        job_ids += await simple_jobs(redis, keys, 20)  # in the log, maybe not read yet
        first_run = (await redis.info("server"))["run_id"]
        redis_to_kill.stop(signal.SIGKILL)
        await asyncio.to_thread(redis_to_kill.start)
        job_ids += await simple_jobs(redis, keys, 20)

        async def drained() -> bool:
            return await lag(redis, keys) == (0, 0.0)

        await wait_for(drained, timeout=60)
        assert not task.done()
        assert (await redis.info("server"))["run_id"] != first_run  # another server process
    finally:
        persister.stop()
        await asyncio.wait_for(task, 10)
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    await redis.aclose()


async def _blocked_reading(redis: Any) -> bool:
    """Is a client blocked in an XREADGROUP? (CLIENT LIST)"""
    for client in await redis.client_list():
        if client.get("cmd") == "xreadgroup" and "b" in client.get("flags", ""):
            return True
    return False


async def test_a_batch_refused_for_one_entry_is_halved_down_to_it(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """A batch Postgres refuses for one entry's data is written again in halves, a refused
    half halved again: the good entries are written in a few commits, about two for each
    halving (entry by entry, it took one each), and the bad one alone is parked."""
    job_ids = await simple_jobs(redis, keys, 100)
    submit = next(p for p in await transition_fields(redis, keys) if p[b"fr"] == b"")
    bad = {**submit, b"p": b"{not json"}  # a payload Postgres refuses as JSON
    bad[b"d"] = bad[b"d"].replace(b'"id":"', b'"id":"X', 1)  # another job id
    await redis.xadd(keys.log(3), bad)
    n = 3 * 100 + 1

    persister = Persister(
        pg_settings.replace(persist_batch_size=1000), redis_as_jobtier, pg_pool, "p1"
    )
    commits: list[int] = []  # the entries of each transaction tried
    write = persister.persist

    async def counted(entries: Sequence[LogEntry], rows: Any = None) -> None:
        commits.append(len(entries))
        await write(entries, rows)

    persister.persist = counted  # type: ignore[method-assign]
    assert await persister.drain() == n - 1
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert persister.stats.parked == 1 and await redis.xlen(keys.log_refused(3)) == 1
    assert await lag(redis, keys) == (0, 0.0)
    assert persister._taken == set()  # every entry acknowledged, the parked one too
    # one batch of every entry, refused, then two halves a level down to ALONE entries, then
    # each of those: 1 + 2 * ceil(log2(301 / 4)) + 4 = 19 at most (it was 1 + 301)
    halvings = 1 + 2 * math.ceil(math.log2(n / persister_module.ALONE))
    assert commits[0] == n and len(commits) <= halvings + persister_module.ALONE, commits
    # a level writes at most half of the level above, rounded up
    assert sum(commits[1:]) <= 2 * n + math.ceil(math.log2(n)), commits


async def test_a_batch_holds_at_most_its_bytes_whatever_its_count(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entries with large payloads are written in batches of at most ``BATCH_BYTES`` (a
    batch of one entry excepted), however many the batch size allows."""
    monkeypatch.setattr(persister_module, "BATCH_BYTES", 20_000)
    job_ids = await simple_jobs(redis, keys, 30, pad=1_500)  # submits of over 1.5 KB each
    persister = Persister(
        pg_settings.replace(persist_batch_size=1000), redis_as_jobtier, pg_pool, "p1"
    )
    sizes: list[tuple[int, int, int]] = []  # (transitions, bytes, entries) of each transaction
    write = persister.persist

    async def measured(entries: Sequence[LogEntry], rows: Any = None) -> None:
        sizes.append((
            len(entries),
            sum(persister_module._size(e) for e in entries),
            len({(e.shard, e.entry_id) for e in entries}),
        ))  # fmt: skip
        await write(entries, rows)

    persister.persist = measured  # type: ignore[method-assign]
    assert await persister.drain() == 90
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert len(sizes) >= 4 and sum(n for n, _, _ in sizes) == 90, sizes  # (all in one, else)
    # a larger one is one entry's (a script's transitions): never cut
    assert all(size <= 20_000 or n == 1 for _, size, n in sizes), sizes
    assert any(n > 1 for _, _, n in sizes), sizes  # (entries small enough to share one)


async def test_a_drain_takes_over_every_entry_a_dead_member_left(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """A member that read entries and died leaves them pending; a drain takes every one of
    them over (its claims scan each stream to the end), however small its batches."""
    job_ids = await simple_jobs(redis, keys, 200)
    dead = Persister(pg_settings, redis_as_jobtier, pg_pool, "dead")
    await dead.consumer.setup()
    taken: list[Any] = []
    for _ in range(3):  # its own pending entries first (none), then the new ones
        taken += (await dead.consumer.read(1_000))[1]
    assert len(taken) == len(await log_entries(redis, keys))  # pending under "dead"

    async def all_idle() -> bool:  # idle past the claim time (the dead member's are)
        for s in range(keys.shards):
            pending = await redis.xpending_range(
                keys.log(s), keys.persist_group(), "-", "+", 1_000, idle=200
            )
            if len(pending) != len([t for t in taken if t[0] == s]):
                return False
        return True

    await wait_for(all_idle)
    live = Persister(
        pg_settings.replace(persist_batch_size=64, persist_claim_idle_seconds=0.2),
        redis_as_jobtier,
        pg_pool,
        "live",
    )
    assert await live.drain() == 600  # the transitions of every entry it took over
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert await lag(redis, keys) == (0, 0.0)


async def test_an_entry_written_is_not_taken_again_before_its_xack_is_sent(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """A read of the persister's own pending entries (after its start, a takeover, a failed
    flush) between a batch's commit and its XACK finds the batch's entries still pending in
    Redis: it does not take them, nor write them, again (a drain wrote a batch twice so)."""
    job_ids = await simple_jobs(redis, keys, 50)
    entries = len(await log_entries(redis, keys))
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    await persister.consumer.setup()
    while await persister._read():
        pass
    assert len(persister._buffer) == 150
    persister._start_flush()
    await asyncio.gather(*persister._inflight)  # committed; its XACKs owed, not yet sent
    persister._reap()
    persister.consumer.reread()  # our pending entries read again from the start
    while await persister._read():
        pass
    assert persister._buffer == []
    assert persister.stats.transitions == 150
    assert len(persister._taken) == entries  # ours until Redis has their XACKs
    await persister._ack()
    assert await lag(redis, keys) == (0, 0.0)
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    persister.consumer.reread()  # acknowledged: nothing pending, nothing kept
    while await persister._read():
        pass
    assert persister._buffer == []
    assert persister._taken == set()


async def test_bad_entries_do_not_stop_the_rest_and_refused_ones_are_parked(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys, caplog: Any
) -> None:
    """An unreadable entry stays pending (a newer persister may read it); one Postgres
    refuses is parked in log:refused and acknowledged, so it holds back neither trimming nor
    the lag, and ``replay_refused`` sends it back."""
    job_ids = await simple_jobs(redis, keys, 20)
    await redis.xadd(keys.log(0), {"d": b"{not a document", "tn": "t1", "fr": "", "w": "api"})
    # valid document, but a payload Postgres refuses as JSON: isolated from its batch
    submit = next(p for p in await transition_fields(redis, keys) if p[b"fr"] == b"")
    bad = {**submit, b"p": b"{not json"}
    bad[b"d"] = bad[b"d"].replace(b'"id":"', b'"id":"X', 1)  # another job id
    await redis.xadd(keys.log(1), bad)
    caplog.set_level(logging.ERROR, logger="jobtier.persist")

    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    assert await persister.drain() == 60
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert persister.stats.bad_entries == 2 and persister.stats.parked == 1
    assert persister._taken == set()  # the parked one too, once acknowledged
    assert "event=bad_log_entry" in caplog.text and "event=entry_refused" in caplog.text
    assert (await lag(redis, keys))[0] == 1  # the unreadable one, never acknowledged
    assert await redis.xlen(keys.log(1)) == 0  # the refused one no longer holds back trimming
    (parked,) = await redis.xrange(keys.log_refused(1))
    assert parked[1][b"p"] == b"{not json" and parked[1][b"d"] == bad[b"d"]
    assert b"json" in parked[1][b"refused_error"].lower()

    assert await replay_refused(redis_as_jobtier, keys) == 1
    assert await redis.xlen(keys.log_refused(1)) == 0
    (back,) = await redis.xrange(keys.log(1))
    assert back[1] == bad  # as it was, without the parking fields
    assert await persister.drain() == 0  # refused again: parked again
    assert persister.stats.parked == 2 and await redis.xlen(keys.log_refused(1)) == 1
    # a replay moves what was parked when it began, not what is parked again meanwhile
    refused_again = await redis.xadd(keys.log_refused(1), {**bad, b"refused_error": b"x"})
    original = redis_as_jobtier.xrange

    async def xrange_then_refuse(*args: Any, **kwargs: Any) -> Any:
        found = await original(*args, **kwargs)
        if found:  # a running persister refuses the replayed entry at once, parking it anew
            await redis_as_jobtier.xadd(keys.log_refused(1), {**bad, b"refused_error": b"again"})
        return found

    redis_as_jobtier.xrange = xrange_then_refuse
    try:
        assert await asyncio.wait_for(replay_refused(redis_as_jobtier, keys), 10) == 2
    finally:
        redis_as_jobtier.xrange = original
    left = await redis.xrange(keys.log_refused(1))
    assert [f[b"refused_error"] for _, f in left] == [b"again"]
    assert left[0][0] > refused_again


async def _until(predicate: Any, timeout: float = 30.0) -> None:
    """Wait for a condition (liveness, not a timing assertion: the bound is generous)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_consumers_of_stopped_persisters_are_forgotten(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool
) -> None:
    keys = Keys(pg_settings.prefix, pg_settings.shards)
    await simple_jobs(redis, keys, 8)
    old = Persister(pg_settings, redis_as_jobtier, pg_pool, "persister-old")
    await old.drain()  # its reads make "persister-old" a consumer of every shard's group

    async def consumers() -> set[str]:
        rows = await redis.xinfo_consumers(keys.log(0), keys.persist_group())
        return {r["name"].decode() if isinstance(r["name"], bytes) else r["name"] for r in rows}

    assert "persister-old" in await consumers()
    await simple_jobs(redis, keys, 8)
    new = Persister(pg_settings, redis_as_jobtier, pg_pool, "persister-new")
    await new.drain()
    assert new.consumer.forget_idle_ms is not None and new.consumer.forget_idle_ms >= 120_000
    assert await new.consumer.forget() == 0  # idle for less than that: kept
    assert "persister-old" in await consumers()
    new.consumer.forget_idle_ms = 0
    assert await new.consumer.forget() == keys.shards
    assert await consumers() == {"persister-new"}


async def test_a_consumer_holding_entries_is_never_forgotten(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool
) -> None:
    """Removing a consumer drops its pending entries from the group (they would be trimmed
    unwritten): one that holds any is kept however long it was idle, and checked in the same
    atomic step that removes the others."""
    keys = Keys(pg_settings.prefix, pg_settings.shards)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "sweeper").consumer.setup()
    job_ids = await simple_jobs(redis, keys, 8)
    for shard in range(keys.shards):  # a persister that read, then died before writing
        await redis.xreadgroup(keys.persist_group(), "dead-holder", {keys.log(shard): ">"})
    sweeper = Persister(pg_settings, redis_as_jobtier, pg_pool, "sweeper")
    sweeper.consumer.forget_idle_ms = 0
    assert await sweeper.consumer.forget() == 0
    rows = await redis.xinfo_consumers(keys.log(0), keys.persist_group())
    # its 3 entries of shard 0: the submits, the claims, the completions of 2 jobs
    assert [r["pending"] for r in rows if r["name"] in (b"dead-holder", "dead-holder")] == [3]
    sweeper.consumer.claim_idle_ms = 0
    await sweeper.drain()  # takes the entries over (then forgets it) and writes them
    rows = await redis.xinfo_consumers(keys.log(0), keys.persist_group())
    assert [r["name"] for r in rows] in ([b"sweeper"], ["sweeper"])
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)


async def _two_jobs_entries(
    redis: Any, keys: Keys
) -> tuple[str, str, dict[tuple[str, int], LogEntry]]:
    """Two jobs through submit, claim and success: (the older id, the newer, their entries by
    (job, version))."""
    older, newer = sorted(await simple_jobs(redis, keys, 2))
    entries = {(e.status.id, e.status.version): e for e in parsed(await log_entries(redis, keys))}
    return older, newer, entries


async def test_a_new_jobs_row_written_first_by_another_batch_is_merged_after_the_others(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    monkeypatch: Any,
) -> None:
    """A batch that creates a job Postgres has a later version of already (another persister
    wrote it first) merges it too, after the rows it merged before, and fills in its payload."""
    older, newer, e = await _two_jobs_entries(redis, keys)
    copied: list[tuple[str, bool]] = []
    copy_new = batch_module.copy_new

    async def spied(conn: Any, table: str, records: Any, columns: Any) -> bool:
        went = await copy_new(conn, table, records, columns)
        copied.append((table, went))
        return went

    monkeypatch.setattr(batch_module, "copy_new", spied)
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    await persister.persist([e[older, 1]])
    await persister.persist([e[newer, 2]])  # the newer job's row, without its payload
    copied.clear()
    await persister.persist([e[older, 2], e[newer, 1]])
    assert copied == [("jobs", False), ("job_transitions", True)]
    rows = {r["id"]: r for r in await pg_pool.fetch("SELECT id, version, payload::text FROM jobs")}
    assert rows[older]["version"] == 2 and rows[newer]["version"] == 2
    assert rows[newer]["payload"] == (e[newer, 1].payload or b"").decode()
    await persister.persist([e[older, 3], e[newer, 3]])
    await assert_pg_matches_redis(redis, pg_pool, keys, [older, newer])


async def test_batches_holding_entries_of_the_same_jobs_at_once_do_not_deadlock(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """One batch moves an older job on and creates a newer one; another, written at the same
    time, moves both on. Each takes its rows' locks in id order, the new job's COPY included,
    so neither waits for the other in a cycle (Postgres would refuse one: a deadlock)."""
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    for _ in range(8):
        older, newer, e = await _two_jobs_entries(redis, keys)
        await persister.persist([e[older, 1]])
        await asyncio.gather(
            persister.persist([e[older, 2], e[newer, 1]]),
            persister.persist([e[older, 3], e[newer, 2], e[newer, 3]]),
        )
        await assert_pg_matches_redis(redis, pg_pool, keys, [older, newer])


async def test_an_entry_whose_one_transition_is_refused_is_parked_once_the_rest_are_written(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """An entry holds the transitions of one script call: one of them refused by Postgres
    parks the entry, whole, once its others are written; it is acknowledged then, neither
    before nor never."""
    job_ids = await simple_jobs(redis, keys, 8)
    first, second = [p for p in await logged(redis, keys.log(1)) if p[b"fr"] == b""]
    bad = {**first, b"p": b"{not json"}  # a payload Postgres refuses as JSON
    bad[b"d"] = bad[b"d"].replace(b'"id":"', b'"id":"X', 1)  # another job id
    entry = {b"n": b"3"}
    for place, part in enumerate([first, bad, second], 1):  # two submits again, and the bad
        entry.update({name + b"%d" % place: value for name, value in part.items()})
    await redis.xadd(keys.log(1), entry)

    persister = Persister(
        pg_settings.replace(persist_batch_size=1000), redis_as_jobtier, pg_pool, "p1"
    )
    assert await persister.drain() == 3 * 8 + 2
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert not await pg_pool.fetchval("SELECT count(*) FROM jobs WHERE id LIKE 'X%'")
    assert persister.stats.parked == 1
    (parked,) = await redis.xrange(keys.log_refused(1))
    assert parked[1][b"n"] == b"3" and parked[1][b"p2"] == b"{not json"
    assert b"json" in parked[1][b"refused_error"].lower()
    assert await lag(redis, keys) == (0, 0.0)
    assert persister._taken == set() and persister.parts._left == {}


async def test_the_lag_counts_the_transitions_of_entries_of_several(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """Pending entries count at the mean of the oldest of them, undelivered ones one by one
    (up to the bound), whatever size the others are: 5 pending entries of 10 transitions and
    3 undelivered of one are 53."""
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "setup").consumer.setup()
    for _ in range(5):
        await redis.xadd(keys.log(0), {b"n": b"10", **{b"d%d" % i: b"{}" for i in range(1, 11)}})
    await redis.xreadgroup(keys.persist_group(), "p2", {keys.log(0): ">"}, count=5)
    for _ in range(3):
        await redis.xadd(keys.log(0), {b"d": b"{}"})
    assert (await lag(redis, keys))[0] == 53
    assert (await lag(redis, keys, exact=1))[0] == 53  # 2 of the 3 at the one read's mean


async def test_the_age_alone_reads_no_entry_where_one_is_pending(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """``oldest_waiting`` (a sampler's, ``jobtier run``'s wait for the write-behind): whether
    anything waits and the age of the oldest, taken from XPENDING's summary on a shard with
    pending entries (delivered before any undelivered one), else from the shard's first
    undelivered entry: not one of those entries of 100 transitions read whole where one is
    pending (``lag``'s cheapest count read the oldest and the newest pending whole, and one
    undelivered: their reads are what its calls cost)."""
    assert await oldest_waiting(redis, keys) == (False, 0.0)  # nothing logged yet
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "setup").consumer.setup()
    big = {b"n": b"100", **{b"d%d" % i: b"{}" for i in range(1, 101)}}
    now = int(time.time() * 1000)
    await redis.xadd(keys.log(0), big, id=f"{now - 60_000}-0")
    await redis.xadd(keys.log(0), big, id=f"{now - 30_000}-0")
    await redis.xadd(keys.log(1), big, id=f"{now - 20_000}-0")
    await redis.xreadgroup(keys.persist_group(), "p2", {keys.log(0): ">"}, count=1)

    await redis.config_resetstat()
    found, age = await oldest_waiting(redis, keys)
    assert found and age >= 60
    reads = (await redis.info("commandstats")).get("cmdstat_xrange", {}).get("calls", 0)
    assert reads == 1  # shard 1's first undelivered entry; none on shard 0
    # a group on no shard yet: every entry waits for it
    found, age = await oldest_waiting(redis, keys, "not-there-yet")
    assert found and age >= 60

    await redis.xack(keys.log(0), keys.persist_group(), f"{now - 60_000}-0")
    found, age = await oldest_waiting(redis, keys)
    assert found and 30 <= age < 60  # shard 0's undelivered one now
    await redis.xreadgroup(
        keys.persist_group(), "p2", {keys.log(0): ">", keys.log(1): ">"}, count=10
    )
    await redis.xack(keys.log(0), keys.persist_group(), f"{now - 30_000}-0")
    await redis.xack(keys.log(1), keys.persist_group(), f"{now - 20_000}-0")
    assert await oldest_waiting(redis, keys) == (False, 0.0)


async def test_the_api_processes_share_one_count_of_the_lag_at_a_time(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """``shared_lag`` (the API's count, for admission and the gauges): the count one process
    made is read by the others while it is current, and made again once it has expired (a
    count runs log_lag.lua on every shard, reading whole entries: what every API process
    paid once a second). A Redis that refuses the write (full, under noeviction) still gets
    its count, unshared."""
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "setup").consumer.setup()
    for _ in range(3):
        await redis.xadd(keys.log(0), {b"d": b"{}"})

    async def counts() -> int:  # log_lag.lua's calls: each begins with an XLEN
        stats = await redis.info("commandstats")
        return int(stats.get("cmdstat_xlen", {}).get("calls", 0))

    await redis.config_resetstat()
    transitions, age, current_for = await shared_lag(redis_as_jobtier, keys)
    assert transitions == 3 and 0 < current_for <= 1 and await counts() == keys.shards
    again = await shared_lag(redis_as_jobtier, keys)  # another API process, within the second
    assert again[0] == 3 and again[1] >= age and again[2] <= current_for
    assert await counts() == keys.shards

    await redis.xadd(keys.log(1), {b"d": b"{}"})
    await redis.delete(lag_key(keys))  # as if expired
    assert (await shared_lag(redis_as_jobtier, keys))[0] == 4
    assert await counts() == 2 * keys.shards

    # not trusted, counted again and written over: a count that would stay current longer
    # than it was made for (PX is replicated as an absolute time: a promoted replica whose
    # clock is behind keeps it longer), one another version wrote, a key of another type
    for planted in ("set", "other", "hash"):
        await redis.delete(lag_key(keys))
        if planted == "set":
            await redis.set(lag_key(keys), "0 0", px=30_000)
        elif planted == "other":
            await redis.set(lag_key(keys), "v2:0", px=500)
        else:
            await redis.hset(lag_key(keys), "transitions", 0)
        transitions, _, current_for = await shared_lag(redis_as_jobtier, keys)
        assert transitions == 4 and current_for <= 1, planted
        assert 0 < await redis.pttl(lag_key(keys)) <= 1000

    await redis.delete(lag_key(keys))
    (memory,) = (await redis.config_get("maxmemory")).values()
    await redis.config_set("maxmemory", 1)
    try:
        assert (await shared_lag(redis_as_jobtier, keys))[0] == 4
    finally:
        await redis.config_set("maxmemory", memory)
    assert await redis.get(lag_key(keys)) is None


async def test_the_lag_counts_pending_entries_unlike_their_oldest_and_newest(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys
) -> None:
    """Pending entries whose oldest and newest are not like the rest (held claims of one job
    each, between two batches of 100 in flight): those two counted exactly, the ones between
    at the mean of those read between them. At the mean of the oldest and the newest, 40
    entries of one and two of 100 were 4,200 transitions, not 240: past a
    JOBTIER_PERSIST_MAX_LAG of 1,000 that the real backlog is far from."""
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "setup").consumer.setup()
    big = {b"n": b"100", **{b"d%d" % i: b"{}" for i in range(1, 101)}}
    stream = keys.log(0)
    await redis.xadd(stream, big, id="1000-0")
    for ms in range(1001, 1041):
        await redis.xadd(stream, {b"d": b"{}"}, id=f"{ms}-0")
    await redis.xadd(stream, big, id="1041-0")
    await redis.xreadgroup(keys.persist_group(), "p2", {stream: ">"}, count=100)
    assert (await lag(redis, keys))[0] == 240
    # the cheapest count (a caller that wants the age, or whether anything waits): the
    # oldest and the newest read, the rest at their mean
    assert (await lag(redis, keys, exact=1, pending=2))[0] == 42 * 100
    # as few as LAG_PENDING_READ: each counted
    await redis.xack(stream, keys.persist_group(), *[f"{ms}-0" for ms in range(1002, 1040)])
    assert (await lag(redis, keys))[0] == 100 + 1 + 1 + 100
    # the ones between close after the oldest (no step finds one from its place on): read
    # from just after it; one held claim, ten batches of 100, one held claim are 1,002
    await redis.delete(stream)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "setup").consumer.setup()
    await redis.xadd(stream, {b"d": b"{}"}, id="1000-0")
    for seq in range(10):
        await redis.xadd(stream, big, id=f"1001-{seq}")
    await redis.xadd(stream, {b"d": b"{}"}, id="9000-0")
    await redis.xreadgroup(keys.persist_group(), "p2", {stream: ">"}, count=100)
    assert (await lag(redis, keys))[0] == 1_002
