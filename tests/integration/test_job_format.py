"""Job hash formats (core/keys.py, "Job hashes"; store/format.py): what each format holds, the
switch of a deployment to a newer format with jobs in every state, and when a process
switches by itself. On the single Redis and on the Redis Cluster."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
from typing import Any, cast

import msgspec
import pytest
from redis.asyncio import RedisCluster

from jobtier.config import Settings
from jobtier.core.errors import Code
from jobtier.core.model import JobSpec, State, decode_status
from jobtier.engine.queue import Queue
from jobtier.status.docs import read_doc
from jobtier.status.reader import StatusReader
from jobtier.store import format as job_format
from jobtier.store.context import submit_items
from tests.fixtures.engine import hold_format_1
from tests.fixtures.redis import StreamEntries
from tests.integration.test_transitions import (
    W,
    claim,
    complete,
    expire_lease,
    fail,
    heartbeat,
    reclaim,
    stopped,
)

pytestmark = pytest.mark.contract

# the format-1 fields a job's document shows, and the document's name for each
SHOWN = {"state": "state", "version": "version", "attempt": "attempt", "prio": "priority",
         "max_attempts": "max_attempts", "queue": "queue", "type": "type"}  # fmt: skip


async def held(queue: Queue, job_id: str) -> dict[bytes, bytes]:
    raw: dict[bytes, bytes] = await queue.redis.hgetall(queue.keys.job(job_id))  # type: ignore[assignment]
    return raw


def agrees_with_doc(fields: dict[str, str], doc_bytes: bytes) -> None:
    """The hash's small fields say what its document says."""
    doc = msgspec.json.decode(doc_bytes)
    for field, name in SHOWN.items():
        assert fields[field] == str(doc[name]), (field, fields[field], doc[name])
    assert fields["created_iso"] == doc["created_at"]
    assert (fields.get("worker") or None) == doc["worker"]


# what only format 1 holds (lib.lua ONLY_1)
FORMAT_1_ONLY = {
    b"type", b"prio", b"state", b"version", b"attempt", b"max_attempts", b"updated", b"run_at",
    b"cancel", b"worker", b"lease_version", b"created_iso", b"run_at_iso", b"lv", b"lt",
    b"queue", b"ckey", b"created",
}  # fmt: skip


async def assert_format(queue: Queue, job_id: str, fmt: int) -> dict[str, str]:
    """The job's hash is in format ``fmt`` and nothing of another is left in it; its fields
    agree with the document a reader gets (rendered from them in format 3)."""
    raw = await held(queue, job_id)
    if fmt == 3:
        assert b"c" in raw and b"t" in raw
        assert not ({b"s", b"doc"} | FORMAT_1_ONLY) & set(raw), set(raw)
    elif fmt == 2:
        assert b"c" in raw and b"s" in raw and b"doc" in raw
        assert not ({b"t"} | FORMAT_1_ONLY) & set(raw), set(raw)
    else:
        assert not {b"c", b"s", b"t"} & set(raw)
        assert raw[b"state"] and raw[b"version"] and raw[b"type"] and raw[b"doc"]
    fields = job_format.job_fields(raw)
    doc = await queue.jobs.status_doc(job_id)
    if fmt < 3:
        assert doc == raw[b"doc"]  # the stored document, as it was
    agrees_with_doc(fields, doc)
    return fields


async def last_logged_doc(queue: Queue, job_id: str) -> bytes:
    entries = await log_entries(queue, job_id)
    doc: bytes = entries[-1][b"d"]
    return doc


async def test_a_redis_without_jobs_is_switched_to_the_newest_format_at_connect(
    queue: Queue,
) -> None:
    """Format 3 stores no document: what a reader gets is rendered from the job's fields,
    byte for byte what the transition logged (and published) for the same version."""
    assert await job_format.formats(queue.redis, queue.keys) == [3] * queue.keys.shards
    sub = await queue.submit("echo", {"n": 1}, concurrency_key="k:1")
    fields = await assert_format(queue, sub.job_id, 3)
    assert fields["ckey"] == "k:1"
    assert await queue.jobs.status_doc(sub.job_id) == await last_logged_doc(queue, sub.job_id)
    job = await claim(queue, sub.job_id, worker="worker with spaces")
    assert job.payload == b'{"n":1}' and job.attempt == 1
    fields = await assert_format(queue, sub.job_id, 3)
    assert fields["worker"] == "worker with spaces" and fields["state"] == "running"
    assert await queue.jobs.status_doc(sub.job_id) == await last_logged_doc(queue, sub.job_id)
    code, _ = await heartbeat(queue, job, worker="worker with spaces", progress=b'{"p":5}')
    assert code is Code.OK
    assert (await assert_format(queue, sub.job_id, 3))["progress"] == '{"p":5}'
    assert await complete(queue, job, worker="worker with spaces") is Code.OK
    status = await queue.status(sub.job_id)
    assert status.state is State.SUCCEEDED and status.progress == {"p": 5}
    await assert_format(queue, sub.job_id, 3)
    assert await queue.jobs.status_doc(sub.job_id) == await last_logged_doc(queue, sub.job_id)


@pytest.mark.parametrize("fmt", [1, 2])
async def test_a_deployment_held_in_an_older_format_writes_what_an_older_jobtier_reads(
    queue: Queue, fmt: int
) -> None:
    """Until the switch, every transition writes what a jobtier from before the newer format
    reads: held in format 2 ('2' in jt:{s}:fmt) the packed fields and the stored document,
    held in format 1 each value in its own field and the document, never the packed ones."""
    await job_format.hold(queue.redis, queue.keys, fmt)
    sub = await queue.submit("flaky", None, max_attempts=2)
    await assert_format(queue, sub.job_id, fmt)
    job = await claim(queue, sub.job_id)
    fields = await assert_format(queue, sub.job_id, fmt)
    assert fields["lease_version"] == str(job.lease_version)
    code, state = await fail(queue, job, delay_ms=5000)
    assert (code, state) == (Code.OK, b"scheduled")
    fields = await assert_format(queue, sub.job_id, fmt)
    assert fields["error"] and fields["attempt"] == "1" and fields["run_at_iso"]


@pytest.mark.parametrize(("start", "end"), [(1, 3), (2, 3), (1, 2)])
async def test_jobs_in_every_state_carry_on_after_the_switch(
    queue: Queue, start: int, end: int
) -> None:
    """Jobs written in an older format (queued, scheduled, running, running with a cancel
    request, one whose lease expires) go on after a switch (`jobtier job-format --upgrade`,
    or a shard held in format 2 from format 1) as if nothing happened: each is moved to the
    new format by its first transition, its document and versions carry on, and its history
    has no gap."""
    await job_format.hold(queue.redis, queue.keys, start)
    running = await queue.submit("echo", None)
    cancelling = await queue.submit("echo", None)
    expiring = await queue.submit("echo", None)
    claimed = {}
    for shard in {queue.keys.shard_of(s.job_id) for s in (running, cancelling, expiring)}:
        claimed.update({j.id: j for j in (await queue.scripts.claim(shard, W, 10, 30_000)).jobs})
    jobs = {s: claimed[s.job_id] for s in (running, cancelling, expiring)}
    queued = await queue.submit("echo", {"q": 1})
    scheduled = await queue.submit("echo", None, delay=3600)
    assert (await queue.cancel(cancelling.job_id)).cancel_requested
    for sub in (queued, scheduled, running, cancelling, expiring):
        await assert_format(queue, sub.job_id, start)
    before = {s.job_id: (await queue.status(s.job_id)).version for s in jobs}

    if end == job_format.NEWEST:
        await job_format.upgrade(queue.redis, queue.keys)
    else:
        await job_format.hold(queue.redis, queue.keys, end)

    # queued: the only ready job: claimed and completed; scheduled: cancelled
    job = await claim(queue, queued.job_id)
    assert job.payload == b'{"q":1}'
    assert await complete(queue, job) is Code.OK
    await assert_format(queue, queued.job_id, end)
    assert (await queue.cancel(scheduled.job_id)).state is State.CANCELLED
    await assert_format(queue, scheduled.job_id, end)
    # running: completes with the lease it was given in format 1
    assert await complete(queue, jobs[running]) is Code.OK
    done = await queue.status(running.job_id)
    assert done.state is State.SUCCEEDED and done.version == before[running.job_id] + 1
    await assert_format(queue, running.job_id, end)
    # a cancel requested in format 1 is still seen by the worker's heartbeat, and obeyed
    assert await heartbeat(queue, jobs[cancelling]) == (Code.OK, 1)
    assert await stopped(queue, jobs[cancelling]) == (Code.OK, b"cancelled")
    status = await queue.status(cancelling.job_id)
    assert status.state is State.CANCELLED and status.cancel_requested
    assert (await assert_format(queue, cancelling.job_id, end))["cancel"] == "1"
    # an expired lease is reclaimed and the job runs again
    await expire_lease(queue, expiring.job_id)
    await reclaim(queue, queue.keys.shard_of(expiring.job_id))
    again = await claim(queue, expiring.job_id, worker="worker-b")
    assert again.attempt == 2
    await assert_format(queue, expiring.job_id, end)
    # every job's logged versions form one chain: each entry names the one before it; and
    # what a reader gets now is, byte for byte, what its last transition logged
    for sub in (queued, scheduled, running, cancelling, expiring):
        assert await queue.jobs.status_doc(sub.job_id) == await last_logged_doc(queue, sub.job_id)
        entries = await log_entries(queue, sub.job_id)
        chain = [(int(e[b"pv"]), decode_status(e[b"d"]).version) for e in entries]
        assert chain[0][0] == 0
        for (_, prev), (pv, _) in itertools.pairwise(chain):
            assert pv == prev, chain


async def log_entries(queue: Queue, job_id: str) -> list[dict[bytes, Any]]:
    shard = queue.keys.shard_of(job_id)
    out = []
    for _, entry in cast(StreamEntries, await queue.redis.xrange(queue.keys.log(shard))):
        if decode_status(entry[b"d"]).id == job_id:
            out.append(entry)
    return out


async def test_a_deployment_with_jobs_is_not_switched_by_a_process(
    settings: Settings, queue_format_1: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis that holds jobs written by an older jobtier (a log, no mark) stays in format 1
    when a process of this jobtier connects, which says so; so does one held by hand ('1',
    '2'); a shard a switched deployment lacks a mark on is switched to the others' format."""
    keys = queue_format_1.keys
    await queue_format_1.submit("echo", None)
    await queue_format_1.redis.delete(*[keys.job_format(s) for s in range(keys.shards)])
    with caplog.at_level(logging.WARNING, logger="jobtier.store.format"):
        other = await Queue.connect(settings)
    try:
        assert await job_format.formats(other.redis, keys) == [1] * keys.shards
        assert "jobtier job-format --upgrade" in caplog.text
        await hold_format_1(other)
        assert await job_format.adopt(other.redis, keys) == 1
        # held in format 2, a shard without a mark joins the others, and the process says
        # that a newer format is there to switch to
        await job_format.hold(other.redis, keys, 2)
        await other.redis.delete(keys.job_format(1))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jobtier.store.format"):
            assert await job_format.adopt(other.redis, keys) == 2
        assert "format=2" in caplog.text and "jobtier job-format --upgrade" in caplog.text
        assert await job_format.formats(other.redis, keys) == [2] * keys.shards
        await job_format.upgrade(other.redis, keys)
        await other.redis.delete(keys.job_format(1))
        assert await job_format.adopt(other.redis, keys) == 3
        assert await job_format.formats(other.redis, keys) == [3] * keys.shards
    finally:
        await other.close()


async def jobtier(*args: str, settings: Settings) -> tuple[int, str]:
    env = {**os.environ, "JOBTIER_REDIS_URL": settings.redis_url,
           "JOBTIER_SHARDS": str(settings.shards)}  # fmt: skip
    if settings.redis_cluster:
        env["JOBTIER_REDIS_CLUSTER"] = "true"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jobtier.cli.main", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


async def test_empty_logs_made_for_consumer_groups_do_not_count_as_jobs(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """A persister or dispatcher that starts first creates the log streams empty (for its
    consumer group): the Redis still holds no job, and is switched; a log whose entries were
    all trimmed (persisted) once held jobs, and is not."""
    keys = queue.keys
    marks = [keys.job_format(s) for s in range(keys.shards)]
    await queue.redis.delete(*marks)
    for shard in range(keys.shards):
        await queue.redis.xgroup_create(keys.log(shard), "jt-persister", id="0", mkstream=True)
    assert await job_format.adopt(queue.redis, keys) == 3
    assert await job_format.formats(queue.redis, keys) == [3] * keys.shards

    await queue.submit("echo", None)
    for shard in range(keys.shards):
        await queue.redis.xtrim(keys.log(shard), maxlen=0)
    await queue.redis.delete(*marks)
    with caplog.at_level(logging.WARNING, logger="jobtier.store.format"):
        assert await job_format.adopt(queue.redis, keys) == 1
    assert "jobtier job-format --upgrade" in caplog.text


async def test_the_command_shows_and_switches_the_format(
    queue_format_1: Queue, settings: Settings
) -> None:
    n = settings.shards
    code, out = await jobtier("job-format", settings=settings)
    assert code == 0 and f"format 1: {n} of {n} shards" in out and "--upgrade" in out, out
    code, out = await jobtier("job-format", "--upgrade", settings=settings)
    assert code == 0 and out.strip() == f"format 3: {n} of {n} shards", out
    keys = queue_format_1.keys
    assert await job_format.formats(queue_format_1.redis, keys) == [3] * keys.shards


async def test_a_shard_held_in_an_older_format_keeps_newer_jobs_as_they_are(queue: Queue) -> None:
    """Scripts never move a job to an older format: held in format 2 after the switch, a
    shard still writes a job already in format 3 in format 3 (its document is still rendered,
    the one logged), and new jobs in format 2."""
    sub = await queue.submit("echo", None)
    job = await claim(queue, sub.job_id)
    await job_format.hold(queue.redis, queue.keys, 2)
    code, _ = await heartbeat(queue, job, progress=b'{"p":1}')  # published, not logged
    assert code is Code.OK
    assert (await assert_format(queue, sub.job_id, 3))["progress"] == '{"p":1}'
    assert await complete(queue, job) is Code.OK
    await assert_format(queue, sub.job_id, 3)
    assert await queue.jobs.status_doc(sub.job_id) == await last_logged_doc(queue, sub.job_id)
    newer = await queue.submit("echo", None)
    await assert_format(queue, newer.job_id, 2)


async def test_a_result_kept_outside_redis_before_the_switch_still_says_where(
    queue: Queue,
) -> None:
    """A job that succeeded in format 2 with its result in the result store (an older
    jobtier: no 'R' flag) keeps the document it stored, result_url included, after the
    switch: read alone, or with its result."""
    await job_format.hold(queue.redis, queue.keys, 2)
    sub = await queue.submit("echo", None)
    job = await claim(queue, sub.job_id)
    assert await complete(queue, job, result=b"@ref-1") is Code.OK
    key = queue.keys.job(sub.job_id)
    await queue.redis.hset(key, "wf", "")  # as a jobtier from before the flag left it
    await job_format.upgrade(queue.redis, queue.keys)
    stored = (await held(queue, sub.job_id))[b"doc"]
    assert b'"result_url":"/v1/jobs/' in stored
    assert await queue.jobs.status_doc(sub.job_id) == stored
    _, doc, result = await read_doc(queue.redis, queue.keys, sub.job_id, "result")
    assert (doc, result) == (stored, b"@ref-1")


async def test_one_read_spans_shards_in_different_formats(queue: Queue) -> None:
    """The status reader reads a batch of jobs in formats 1, 2 and 3 side by side (on a single
    server in one call across shards; on a cluster one call per shard): each comes back as
    its transition logged it."""
    keys = queue.keys
    marks = {0: "1", 1: "2"}  # the other shards: format 3
    for shard, mark in marks.items():
        await queue.redis.set(keys.job_format(shard), mark)
    items = [
        queue.produce.prepare(JobSpec(type="echo", payload={"s": shard}), "t1", keys.new_id(shard))
        for shard in range(keys.shards)
        for _ in range(2)
    ]
    assert {o.code for o in await submit_items(queue.store, items)} == {Code.OK}
    ids = [item.job_id for item in items]
    for shard in marks:
        assert b"doc" in await held(queue, ids[2 * shard])
    assert b"doc" not in await held(queue, ids[-1])
    reader = StatusReader(queue.redis, keys, near_cache=False, coalesce=True)
    found = await asyncio.gather(*(reader.get(i) for i in ids))
    cluster = isinstance(queue.redis, RedisCluster)
    assert reader.batches == 1 and reader.script_calls == (keys.shards if cluster else 1)
    for job_id, status in zip(ids, found, strict=True):
        assert status is not None and status[1] == await last_logged_doc(queue, job_id)
