"""The one job-hash format (core/keys.py, "Job hashes"; store/format.py): a new Redis is marked
with it, a process refuses a deployment that holds older data, and ``jobtier job-format
--upgrade`` rewrites older hashes (formats 1 and 2) and the ready lists from before named
queues once, after which every job carries on. On the single Redis and on the Redis Cluster.

Older hashes are written here by hand as the jobtier before this one left them (lib.lua at
1d30c84): format 1 each small field apart (FIELDS_1, and 'created' in ms), format 2 the
changing ones packed in 's'; both with the rendered status document in 'doc'. A job is made
by today's scripts and its hash then rewritten so: its ready list, sets, counters and log
entries are what either format leaves, since the format did not change them."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from datetime import datetime
from typing import Any, cast

import pytest
from redis.typing import EncodableT, FieldT

from jobtier.config import Settings
from jobtier.core.errors import Code, ConfigError
from jobtier.core.model import ClaimedJob, JobSpec, State, decode_status
from jobtier.engine.queue import Queue
from jobtier.status.docs import read_doc
from jobtier.store import format as job_format
from jobtier.store.context import submit_items
from tests.fixtures.redis import logged
from tests.integration.test_transitions import W, claim, complete, fail, make_due, promote

pytestmark = pytest.mark.contract

# what format 3 holds that no older format did, and what only older formats held
NEW_ONLY = {b"c", b"t"}
OLD_ONLY = {name.encode() for name in (*job_format.C_FIELDS, *job_format.T_FIELDS)} | {
    b"created",
    b"s",
    b"doc",
}


async def held(queue: Queue, job_id: str) -> dict[bytes, bytes]:
    return cast(dict[bytes, bytes], await queue.redis.hgetall(queue.keys.job(job_id)))


def ms_of(iso: str) -> int:
    return round(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)


async def downgrade(
    queue: Queue, job_id: str, fmt: int, before: tuple[str, ...] = (), doc: bytes | None = None
) -> bytes:
    """Rewrite the job's hash as a jobtier before format 3 held it, in format ``fmt``, with
    the document it stored (``doc``, else the one it reads as now); ``before`` (format 1):
    fields of a job from before they existed ('queue', 'lv' with 'lt', 'created_iso': then
    only 'created' says when). Returns the stored document."""
    key = queue.keys.job(job_id)
    raw = await held(queue, job_id)
    doc = doc or await queue.jobs.status_doc(job_id)
    fields = job_format.job_fields(raw)
    if fmt == 2:
        old: dict[FieldT, EncodableT] = {"s": raw[b"t"], "doc": doc}
    else:
        # a field that holds '' is the same as an absent one to format 1: a new job's empty
        # fields were not written
        small = [*job_format.C_FIELDS, *job_format.T_FIELDS]
        old = {name: fields[name] for name in small if fields[name] != ""}
        old["created"] = ms_of(fields["created_iso"])
        old["doc"] = doc
        for name in before:
            old.pop(name, None)
            if name == "lv":
                old.pop("lt", None)
    pipe = queue.redis.pipeline(transaction=False)
    pipe.hdel(key, "t", *(["c"] if fmt == 1 else []))
    pipe.hset(key, mapping=old)
    await pipe.execute()
    return doc


async def to_old_ready_list(queue: Queue, job_id: str) -> None:
    """Move a queued job of the default queue to the ready list of before named queues."""
    r, keys = queue.redis, queue.keys
    shard = keys.shard_of(job_id)
    fields = job_format.job_fields(await held(queue, job_id))
    prio, tenant = fields["prio"], fields["tenant"]
    ready = keys.ready(shard, "default", prio, tenant)
    assert await r.lrem(ready, 0, job_id) == 1
    if not await r.llen(ready):
        await r.lrem(keys.ring(shard, "default", prio), 0, tenant)
    await r.hincrby(keys.queue_counts(shard), f"default:{prio}", -1)
    await r.lpush(f"{keys.base(shard)}q:{prio}", job_id)


async def mark_all(queue: Queue, value: str) -> None:
    for shard in range(queue.keys.shards):
        await queue.redis.set(queue.keys.job_format(shard), value)


async def marks(queue: Queue) -> list[bytes | None]:
    keys = queue.keys
    return [
        cast(bytes | None, await queue.redis.get(keys.job_format(s))) for s in range(keys.shards)
    ]


async def log_entries(queue: Queue, job_id: str) -> list[dict[bytes, Any]]:
    shard = queue.keys.shard_of(job_id)
    out = []
    for entry in await logged(queue.redis, queue.keys.log(shard)):
        if decode_status(entry[b"d"]).id == job_id:
            out.append(entry)
    return out


async def assert_history_whole(queue: Queue, job_id: str) -> None:
    """Every logged entry names the version of the one before (the first: 0), and what a
    reader gets now is, byte for byte, what the last one logged."""
    entries = await log_entries(queue, job_id)
    chain = [(int(e[b"pv"]), decode_status(e[b"d"]).version) for e in entries]
    assert chain[0][0] == 0, chain
    for (_, prev), (pv, _) in itertools.pairwise(chain):
        assert pv == prev, chain
    assert await queue.jobs.status_doc(job_id) == entries[-1][b"d"]


async def submit_in(queue: Queue, shard: int, spec: JobSpec) -> str:
    item = queue.produce.prepare(spec, "t1", queue.keys.new_id(shard))
    (outcome,) = await submit_items(queue.store, [item])
    assert outcome.code is Code.OK
    return item.job_id


# --- a new Redis -------------------------------------------------------------------------------
async def test_a_new_redis_is_marked_at_connect_and_written_in_format_3(queue: Queue) -> None:
    """Format 3 stores no document: what a reader gets is rendered from the job's fields,
    byte for byte what the transition logged (and published) for the same version."""
    assert await marks(queue) == [b"3"] * queue.keys.shards
    sub = await queue.submit("echo", {"n": 1}, concurrency_key="k:1")
    raw = await held(queue, sub.job_id)
    assert set(raw) >= NEW_ONLY and not OLD_ONLY & set(raw), set(raw)
    assert job_format.job_fields(raw)["ckey"] == "k:1"
    job = await claim(queue, sub.job_id, worker="worker with spaces")
    assert job_format.job_fields(await held(queue, sub.job_id))["worker"] == "worker with spaces"
    assert await complete(queue, job, worker="worker with spaces") is Code.OK
    await assert_history_whole(queue, sub.job_id)


async def test_empty_logs_made_for_consumer_groups_do_not_count_as_jobs(queue: Queue) -> None:
    """A persister or dispatcher that starts first creates the log streams empty (for its
    consumer group): the Redis still holds no job, and is marked; a log whose entries were
    all trimmed (persisted) once held jobs, and a process refuses it unmarked."""
    keys = queue.keys
    await queue.redis.delete(*[keys.job_format(s) for s in range(keys.shards)])
    for shard in range(keys.shards):
        await queue.redis.xgroup_create(keys.log(shard), "jt-persister", id="0", mkstream=True)
    await job_format.adopt(queue.redis, keys)
    assert await marks(queue) == [b"3"] * keys.shards

    sub = await queue.submit("echo", None)
    await queue.redis.xtrim(keys.log(keys.shard_of(sub.job_id)), maxlen=0)
    await queue.redis.delete(*[keys.job_format(s) for s in range(keys.shards)])
    with pytest.raises(ConfigError, match=f"shard {keys.shard_of(sub.job_id)}: jobs from before"):
        await job_format.adopt(queue.redis, keys)


# --- a deployment this jobtier cannot read ---------------------------------------------------
@pytest.mark.parametrize(
    "held_by", ["format 1", "format 2", "no mark", "old ready lists", "not looked over"]
)
async def test_a_process_refuses_a_deployment_it_cannot_read(
    queue: Queue, settings: Settings, held_by: str
) -> None:
    keys = queue.keys
    job_id = await submit_in(queue, 1, JobSpec(type="echo"))
    if held_by == "format 1":
        await queue.redis.set(keys.job_format(1), "1")
        problem = "shard 1: job hashes in format 1"
    elif held_by == "format 2":
        await queue.redis.set(keys.job_format(1), "2")
        problem = "shard 1: job hashes in format 2"
    elif held_by == "no mark":  # a deployment from before marks; shards 0, 2, 3 never logged
        await queue.redis.delete(*[keys.job_format(s) for s in range(keys.shards)])
        problem = "shard 1: jobs from before format marks (format 1)"
    elif held_by == "not looked over":  # marked "3" by an earlier jobtier, or mid-upgrade
        await queue.redis.delete(keys.format_done(1))
        problem = "shard 1: marked format 3 by an earlier jobtier, not yet looked over"
    else:
        await to_old_ready_list(queue, job_id)
        problem = "shard 1: ready lists from before named queues"
    with pytest.raises(ConfigError) as refused:
        await Queue.connect(settings, catalog=False)
    message = str(refused.value)
    assert problem in message and "`jobtier job-format --upgrade`" in message, message
    assert "shard 0" not in message and "shards" not in message, message
    # what a refusing process found stays as it was (it only marks what never held a job)
    expected = {"format 1": b"1", "format 2": b"2", "no mark": None}.get(held_by, b"3")
    assert (await marks(queue))[1] == expected
    if held_by == "not looked over":
        assert not await queue.redis.exists(keys.format_done(1))
    if held_by == "no mark":
        assert (await marks(queue))[0] == b"3"
    await job_format.upgrade(queue.redis, keys)
    await (await Queue.connect(settings, catalog=False)).close()  # readable once upgraded
    assert await queue.redis.exists(keys.format_done(1))


async def test_a_log_that_cannot_be_read_is_not_taken_for_a_new_redis(
    queue: Queue, settings: Settings
) -> None:
    """Only "no such key" says a shard's log was never written: another refusal (here a key
    of another type) raises, and nothing is marked."""
    keys = queue.keys
    await queue.redis.delete(keys.job_format(2), keys.format_done(2))
    await queue.redis.set(keys.log(2), "not a stream")
    with pytest.raises(Exception, match="WRONGTYPE"):
        await Queue.connect(settings, catalog=False)
    assert (await marks(queue))[2] is None


async def test_the_upgrade_gives_a_job_the_logged_version_an_earlier_jobtier_left_empty(
    queue: Queue,
) -> None:
    """A format-3 hash of a job last changed before 'lv' existed has it empty: the upgrade
    writes what that jobtier read in its place (its version, then its time), and the job
    carries on, its history chained."""
    sub = await queue.submit("echo", 1)
    key = queue.keys.job(sub.job_id)
    t = cast(bytes, await queue.redis.hget(key, "t")).split(b" ", len(job_format.T_FIELDS) - 1)
    lv = job_format.T_FIELDS.index("lv")
    t[lv], t[lv + 1] = b"", b""
    await queue.redis.hset(key, "t", b" ".join(t))
    done = await job_format.upgrade(queue.redis, queue.keys)
    assert done.hashes == 1
    fields = job_format.job_fields(await held(queue, sub.job_id))
    assert (fields["lv"], fields["lt"]) == (fields["version"], fields["updated"])
    job = await claim(queue, sub.job_id)
    assert await complete(queue, job) is Code.OK
    await assert_history_whole(queue, sub.job_id)


# --- the upgrade -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [1, 2])
async def test_jobs_in_every_state_carry_on_after_the_upgrade(
    queue: Queue, settings: Settings, fmt: int
) -> None:
    """Jobs written in format 1 or 2 — running, succeeded, succeeded with a result kept
    outside Redis ('R', and from before the flag), failed and dead-lettered, waiting for a
    dependency, scheduled, queued, and one queued from before queues, lv and created_iso in
    the ready lists of before named queues — are rewritten by the upgrade and carry on: each
    reads as the document it stored, runs, finishes or is replayed, and its history has no
    gap."""
    keys = queue.keys
    # jobs that run first: claimed in one call per shard, before anything else is ready
    running = await submit_in(queue, 0, JobSpec(type="echo"))
    done = await submit_in(queue, 0, JobSpec(type="echo", payload={"n": 1}))
    stored = await submit_in(queue, 1, JobSpec(type="echo"))
    stored_unflagged = await submit_in(queue, 2, JobSpec(type="echo"))
    dead = await submit_in(queue, 3, JobSpec(type="flaky", max_attempts=1))
    claimed: dict[str, ClaimedJob] = {}
    for shard in range(keys.shards):
        claimed.update({j.id: j for j in (await queue.scripts.claim(shard, W, 10, 60_000)).jobs})
    assert set(claimed) == {running, done, stored, stored_unflagged, dead}
    assert await complete(queue, claimed[done]) is Code.OK
    assert await complete(queue, claimed[stored], result=b"@ref-1") is Code.OK
    assert await complete(queue, claimed[stored_unflagged], result=b"@ref-2") is Code.OK
    assert await fail(queue, claimed[dead], delay_ms=-1) == (Code.OK, b"failed")
    # a jobtier from before the 'R' flag stored the document, result_url included, and no flag
    unflagged_doc = await queue.jobs.status_doc(stored_unflagged)
    await queue.redis.hset(keys.job(stored_unflagged), "wf", "")
    # jobs that wait
    waiting = (await queue.submit("echo", None, depends_on=[running], tenant="t1")).job_id
    scheduled = await submit_in(queue, 2, JobSpec(type="echo", delay=3600))
    queued = await submit_in(queue, 0, JobSpec(type="echo", payload={"q": 1}))
    ancient = await submit_in(queue, 1, JobSpec(type="echo", payload={"a": 1}))
    await to_old_ready_list(queue, ancient)
    ids = [running, done, stored, stored_unflagged, dead, waiting, scheduled, queued, ancient]
    versions = {i: (await queue.status(i)).version for i in ids}

    # the deployment as the jobtier before this one left it
    docs = {i: await downgrade(queue, i, fmt) for i in ids if i not in (ancient, stored_unflagged)}
    docs[stored_unflagged] = await downgrade(queue, stored_unflagged, fmt, doc=unflagged_doc)
    docs[ancient] = await downgrade(queue, ancient, 1, ("queue", "lv", "created_iso"))
    await mark_all(queue, str(fmt))
    assert b'"result_url":"/v1/jobs/' in docs[stored_unflagged]
    assert b'"dependencies":{"total":1' in docs[waiting]
    with pytest.raises(ConfigError, match="jobtier job-format --upgrade"):
        await Queue.connect(settings, catalog=False)

    upgraded = await job_format.upgrade(queue.redis, keys)
    assert upgraded == job_format.Upgraded(len(ids), 0, 1, 0, keys.shards)
    assert await marks(queue) == [b"3"] * keys.shards
    for i in ids:
        raw = await held(queue, i)
        assert set(raw) >= NEW_ONLY and not OLD_ONLY & set(raw), (i, set(raw))
        assert await queue.jobs.status_doc(i) == docs[i], i  # the document it stored
    assert job_format.job_fields(await held(queue, ancient))["queue"] == "default"
    assert b"R" in (await held(queue, stored_unflagged))[b"wf"]
    for job_id, ref in ((stored, b"@ref-1"), (stored_unflagged, b"@ref-2")):
        _, doc, result = await read_doc(queue.redis, keys, job_id, "result")
        assert (doc, result) == (docs[job_id], ref)
    # a second upgrade finds nothing left to do
    before = {i: await held(queue, i) for i in ids}
    assert await job_format.upgrade(queue.redis, keys) == job_format.Upgraded(
        0, 0, 0, 0, keys.shards
    )
    assert {i: await held(queue, i) for i in ids} == before
    other = await Queue.connect(settings, catalog=False)  # and processes start
    await other.close()

    # running: completes with the lease it was given before the upgrade
    assert await complete(queue, claimed[running]) is Code.OK
    finished = await queue.status(running)
    assert finished.state is State.SUCCEEDED and finished.version == versions[running] + 1
    # queued, the ancient one and the scheduled one once due: claimed and completed
    for job_id, payload in ((queued, b'{"q":1}'), (ancient, b'{"a":1}')):
        job = await claim(queue, job_id)
        assert job.payload == payload and job.attempt == 1
        assert await complete(queue, job) is Code.OK
    await make_due(queue, scheduled)
    assert (await promote(queue, 2)).moved == 1
    assert await complete(queue, await claim(queue, scheduled)) is Code.OK
    # dead-lettered: replayed; waiting: cancelled
    assert (await queue.jobs.replay(dead)).state is State.QUEUED
    assert (await queue.cancel(waiting)).state is State.CANCELLED
    for job_id in (running, queued, ancient, scheduled, dead, waiting):
        status = await queue.status(job_id)
        assert status.version > versions[job_id], job_id
        await assert_history_whole(queue, job_id)
    stats = await queue.admin.stats()
    assert stats["total"]["queued"] == 1  # the replayed job
    assert stats["total"]["running"] == 0


# --- the command ---------------------------------------------------------------------------------
async def jobtier(*args: str, settings: Settings) -> tuple[int, str]:
    env = {
        **os.environ,
        "JOBTIER_REDIS_URL": settings.redis_url,
        "JOBTIER_SHARDS": str(settings.shards),
    }
    if settings.redis_cluster:
        env["JOBTIER_REDIS_CLUSTER"] = "true"
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "jobtier.cli.main", *args),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


async def test_the_command_shows_and_upgrades(queue: Queue, settings: Settings) -> None:
    n = settings.shards
    code, out = await jobtier("job-format", settings=settings)
    assert code == 0 and out.strip() == f"readable: {n} of {n} shards (format 3)", out
    job_id = await submit_in(queue, 2, JobSpec(type="echo"))
    doc = await downgrade(queue, job_id, 1)
    # one whose stored document is not what its fields render (counted, not kept), and an
    # old ready list that names a job Redis no longer holds (dropped from it)
    odd = await submit_in(queue, 2, JobSpec(type="echo"))
    await downgrade(queue, odd, 2, doc=b'{"id":"odd"}')
    await queue.redis.lpush(f"{queue.keys.base(2)}q:low", queue.keys.new_id(2))
    await queue.redis.set(queue.keys.job_format(2), "1")
    code, out = await jobtier("job-format", settings=settings)
    assert code == 0, out
    assert f"readable: {n - 1} of {n} shards" in out, out
    assert f"needs `jobtier job-format --upgrade`: 1 of {n} shards" in out, out
    assert "shard 2: job hashes in format 1" in out, out
    assert "shard 2: ready lists from before named queues" in out, out
    assert "1 jobs wait in the ready lists of before named queues" in out, out
    code, out = await jobtier("job-format", "--upgrade", settings=settings)
    assert code == 0, out
    assert (
        "rewrote 2 job hashes into format 3 (1 render another document than the one they "
        "stored); moved 0 jobs from the ready lists of before named queues (1 no longer "
        f"queued: dropped from them); marked {n} shards format 3"
    ) in out, out
    assert out.strip().endswith(f"readable: {n} of {n} shards (format 3)"), out
    assert await queue.jobs.status_doc(job_id) == doc
