"""Recurring schedules fired by real schedulers on a real Redis: once per slot, always."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from collections import Counter
from datetime import datetime

from jobtier.config import Settings
from jobtier.core.model import State, decode_status
from jobtier.engine.cron import CronMirror, MirrorDef, now_ms
from jobtier.engine.queue import Queue
from jobtier.scheduler import Scheduler
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.fixtures.redis import logged
from tests.tasks import registry


def interval_def(
    seconds: float, misfire: str = "fire_once", anchor: int | None = None
) -> MirrorDef:
    return MirrorDef(
        tenant="acme", type="echo", priority="normal", max_attempts=1, cron=None, timezone="UTC",
        interval_ms=round(seconds * 1000), anchor_ms=anchor if anchor is not None else now_ms(),
        misfire=misfire,
    )  # fmt: skip


async def fired(queue: Queue) -> Counter[int]:
    """run_at (slot, ms) -> how many jobs the log says were created for it."""
    slots: Counter[int] = Counter()
    for shard in range(queue.keys.shards):
        for fields in await logged(queue.redis, queue.keys.log(shard)):
            doc = decode_status(fields[b"d"])
            if fields[b"fr"] == b"" and doc.run_at:
                slots[round(datetime.fromisoformat(doc.run_at).timestamp() * 1000)] += 1
    return slots


async def test_two_racing_schedulers_fire_each_slot_once(queue: Queue, settings: Settings) -> None:
    # the default misfire grace (60 s) is far above any stall of a loaded machine: every
    # slot is fired as itself, however late, so a skipped one is a bug, not a slow run
    assert settings.cron_misfire_grace_seconds >= 60
    mirror = CronMirror(queue.redis, queue.keys, queue.scripts)
    anchor = now_ms()
    await mirror.put(
        "SCHED0000000000000000000001",
        interval_def(0.1, anchor=anchor),
        b'"tick"',
        anchor + 100,
        False,
    )
    second = await Queue.connect(settings, catalog=False)
    a, b = Scheduler(queue.store), Scheduler(second.store)
    tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:
        # both race for every slot: each wakes for the same next-fire time
        await wait_for(lambda: a.stats.fired + b.stats.fired >= 10, timeout=60)
    finally:
        a.stop()
        b.stop()
        await asyncio.gather(*tasks)
        await second.close()
    slots = await fired(queue)
    assert set(slots.values()) == {1}  # no slot fired twice
    expected = [anchor + 100 * k for k in range(1, len(slots) + 1)]
    assert sorted(slots) == expected  # and none was skipped
    assert a.stats.fired + b.stats.fired == len(slots) >= 10


async def test_misfire_policies_with_a_controlled_clock(queue: Queue) -> None:
    mirror = CronMirror(queue.redis, queue.keys, queue.scripts)
    t0 = 1_900_000_000_000
    for policy, name in [("skip", "A"), ("fire_once", "B"), ("fire_all", "C")]:
        sid = name * 26
        await mirror.put(sid, interval_def(60, policy, anchor=t0), b"null", t0 + 60_000, False)
    # the scheduler was away for ten minutes: slots t0+1min … t0+10min were missed, the last
    # by 10 s, past the 5 s grace (one within it would be on time: fired by every policy)
    now = t0 + 10 * 60_000 + 10_000
    created = sum(
        [(await mirror.fire_due(s, now, grace_ms=5_000))[0] for s in range(queue.keys.shards)]
    )
    assert created == 0 + 1 + 10
    times = await mirror.times(["A" * 26, "B" * 26, "C" * 26])
    for sid in times:
        assert times[sid][0] == t0 + 11 * 60_000  # every policy resumes at the next slot
    assert times["A" * 26][1] is None and times["B" * 26][1] == t0 + 10 * 60_000
    # firing the same due state again (a replayed call) creates nothing: the CAS refuses it
    again = sum(
        [(await mirror.fire_due(s, now, grace_ms=5_000))[0] for s in range(queue.keys.shards)]
    )
    assert again == 0


async def test_paused_and_deleted_schedules_do_not_fire(queue: Queue) -> None:
    mirror = CronMirror(queue.redis, queue.keys, queue.scripts)
    t0 = now_ms() - 1000
    await mirror.put("P" * 26, interval_def(1, anchor=t0), b"null", t0, True)  # paused
    await mirror.put("D" * 26, interval_def(1, anchor=t0), b"null", t0, False)
    await mirror.remove("D" * 26)
    made = sum([(await mirror.fire_due(s, now_ms(), 60_000))[0] for s in range(queue.keys.shards)])
    assert made == 0 and await fired(queue) == Counter()


async def test_killed_scheduler_catches_up_once_after_restart(settings: Settings) -> None:
    # a slot more than a second late counts as missed: far above a running scheduler's
    # delay on a loaded machine, so the only missed slots are those of the downtime
    interval, grace = 250, 1000
    settings = settings.replace(cron_misfire_grace_seconds=grace / 1000)
    queue = await Queue.connect(settings, catalog=False)
    try:
        mirror = CronMirror(queue.redis, queue.keys, queue.scripts)
        anchor = now_ms()
        await mirror.put(
            "K" * 26,
            interval_def(interval / 1000, "fire_once", anchor=anchor),
            b"null",
            anchor + interval,
            False,
        )
        env = dict(os.environ, JOBTIER_REDIS_URL=settings.redis_url, JOBTIER_SHARDS=str(settings.shards),
                   JOBTIER_CRON_MISFIRE_GRACE_SECONDS=str(grace / 1000), JOBTIER_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")  # fmt: skip
        args = [sys.executable, "-m", "jobtier.cli.main", "scheduler"]
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        async def some_fired() -> bool:
            return len(await fired(queue)) >= 3

        await wait_for(some_fired, timeout=20)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        down_from = max(await fired(queue))
        # down until the slot after the last fired is past the grace, and four more slots
        # have gone by: the restarted scheduler finds them missed (Redis's clock is this
        # machine's, which now_ms reads)
        missed_until = down_from + interval + grace + 4 * interval
        await wait_for(lambda: now_ms() > missed_until, timeout=30)
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        restarted = now_ms()

        async def resumed() -> bool:
            return len([s for s in await fired(queue) if s > restarted]) >= 3

        try:
            await wait_for(resumed, timeout=20)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
        slots = await fired(queue)
        assert set(slots.values()) == {1}  # never twice
        ordered = sorted(slots)
        gaps = [b - a for a, b in itertools.pairwise(ordered)]
        # every step is one interval, but for one jump over the downtime: the slots missed
        # while no scheduler ran were not fired one by one (fire_once), only the latest
        big = [g for g in gaps if g != interval]
        assert len(big) == 1 and big[0] >= 4 * interval, gaps
        catch_up = ordered[gaps.index(big[0]) + 1]
        assert ordered[gaps.index(big[0])] == down_from and catch_up > restarted - 600
    finally:
        await queue.close()


async def test_delayed_jobs_never_start_early(queue: Queue, background: Background) -> None:
    background.start(Scheduler(queue.store))
    background.start(worker_for(queue, registry))
    subs = [await queue.submit("echo", i, delay=0.05 * (i % 8)) for i in range(40)]
    ids = {s.job_id for s in subs}

    async def done() -> bool:
        return all([(await queue.status(i)).state is State.SUCCEEDED for i in ids])

    await wait_for(done, timeout=20)
    for shard in range(queue.keys.shards):
        for fields in await logged(queue.redis, queue.keys.log(shard)):
            doc = decode_status(fields[b"d"])
            if doc.id in ids and doc.state is State.RUNNING and doc.run_at:
                started = datetime.fromisoformat(doc.updated_at)
                # both times are Redis's clock
                assert started >= datetime.fromisoformat(doc.run_at), doc


async def test_a_hung_postgres_does_not_hold_up_promotion(
    queue: Queue, background: Background
) -> None:
    from jobtier.persist.db import create_pool
    from jobtier.persist.schedule_store import ScheduleStore

    hung: list[asyncio.StreamWriter] = []

    async def accept_and_say_nothing(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        hung.append(writer)

    server = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = await create_pool(
        f"postgresql://nobody@127.0.0.1:{port}/none", min_size=0, max_size=1, timeout=60
    )
    try:
        background.start(Scheduler(queue.store, schedules=ScheduleStore(pool)))
        sub = await queue.submit("echo", None, delay=0.2)

        async def promoted() -> bool:
            return (await queue.status(sub.job_id)).state is State.QUEUED

        await wait_for(promoted, timeout=10)  # reconciling waits on Postgres meanwhile
        assert hung  # it really did try Postgres
    finally:
        await background.stop()
        pool.terminate()
        server.close()
        for writer in hung:
            writer.close()
