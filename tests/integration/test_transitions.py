"""Every transition of the state machine, and every refusal, through the real Lua scripts,
on the single Redis and on the Redis Cluster (the ``contract`` marker runs each test on both)."""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any, cast

import msgspec
import pytest
from redis.exceptions import ResponseError

from jobtier.core.errors import Code, IdempotencyConflict, JobNotFound, TransitionRefused
from jobtier.core.model import ClaimedJob, JobSpec, JobStatus, State, Submitted, decode_status
from jobtier.engine.queue import Queue
from jobtier.store import format as job_format
from jobtier.store.calls import (
    SubmitItem,
    complete_call,
    fail_call,
    heartbeat_call,
    parse_pairs,
    parse_promote,
    parse_reclaim,
    parse_submit,
    promote_call,
    reclaim_call,
    stopped_call,
    submit_call,
)
from jobtier.store.context import SPREAD_FROM
from jobtier.store.redis import RedisClient
from tests.fixtures.engine import wait_for
from tests.fixtures.redis import logged

pytestmark = pytest.mark.contract

W = "worker-a"


async def claim(queue: Queue, job_id: str, worker: str = W, lease_ms: int = 30_000) -> ClaimedJob:
    shard = queue.keys.shard_of(job_id)
    batch = await queue.scripts.claim(shard, worker, 10, lease_ms)
    (job,) = [j for j in batch.jobs if j.id == job_id]
    return job


async def complete(
    queue: Queue,
    job: ClaimedJob,
    worker: str = W,
    version: int | None = None,
    result: bytes = b'"done"',
) -> Code:
    shard = queue.keys.shard_of(job.id)
    lv = job.lease_version if version is None else version
    (code,) = await queue.scripts.call(*complete_call(shard, worker, 60, [(job.id, lv, result)]))
    return Code(code)


async def fail(queue: Queue, job: ClaimedJob, delay_ms: int, worker: str = W) -> tuple[Code, bytes]:
    shard = queue.keys.shard_of(job.id)
    reply = await queue.scripts.call(
        *fail_call(
            shard,
            worker,
            60,
            [(job.id, job.lease_version, b'{"type":"E","message":"boom"}', delay_ms)],
        )
    )
    return parse_pairs(reply)[0]


async def heartbeat(
    queue: Queue, job: ClaimedJob, worker: str = W, progress: bytes = b""
) -> tuple[Code, int]:
    shard = queue.keys.shard_of(job.id)
    reply = await queue.scripts.call(
        *heartbeat_call(shard, worker, 30_000, [(job.id, job.lease_version, progress)])
    )
    return parse_pairs(reply)[0]


async def stopped(queue: Queue, job: ClaimedJob, worker: str = W) -> tuple[Code, bytes]:
    shard = queue.keys.shard_of(job.id)
    reply = await queue.scripts.call(
        *stopped_call(shard, worker, 60, [(job.id, job.lease_version)])
    )
    return parse_pairs(reply)[0]


async def expire_lease(queue: Queue, job_id: str) -> None:
    """Make the lease look expired (as if the worker stopped heartbeating long ago)."""
    shard = queue.keys.shard_of(job_id)
    await queue.redis.zadd(queue.keys.active(shard), {job_id: 1})


async def make_due(queue: Queue, job_id: str) -> None:
    shard = queue.keys.shard_of(job_id)
    await queue.redis.zadd(queue.keys.sched(shard), {job_id: 1})


async def reclaim(queue: Queue, shard: int) -> Any:
    s = queue.settings
    return parse_reclaim(
        await queue.scripts.call(
            *reclaim_call(shard, 100, s.retention_seconds, s.dead_retention_seconds)
        )
    )


async def promote(queue: Queue, shard: int) -> Any:
    return parse_promote(await queue.scripts.call(*promote_call(shard, 100)))


async def history(queue: Queue, job_id: str) -> list[tuple[str, str, int]]:
    """(from, to, version) of every log entry of the job, in order."""
    shard = queue.keys.shard_of(job_id)
    out = []
    for fields in await logged(queue.redis, queue.keys.log(shard)):
        doc = decode_status(fields[b"d"])
        if doc.id == job_id:
            out.append((fields[b"fr"].decode(), doc.state.value, doc.version))
    return out


async def test_submit_claim_complete(queue: Queue) -> None:
    sub = await queue.submit("echo", {"x": 1})
    assert sub.created and sub.status.state is State.QUEUED and sub.status.version == 1
    job = await claim(queue, sub.job_id)
    assert (job.attempt, job.lease_version, job.payload) == (1, 2, b'{"x":1}')
    running = await queue.status(sub.job_id)
    assert running.state is State.RUNNING and running.worker == W and running.attempt == 1
    assert await complete(queue, job) is Code.OK
    status, result = await queue.result(sub.job_id)
    assert status.state is State.SUCCEEDED and status.version == 3 and result == "done"
    assert await history(queue, sub.job_id) == [
        ("", "queued", 1),
        ("queued", "running", 2),
        ("running", "succeeded", 3),
    ]
    ttl = await queue.redis.ttl(queue.keys.job(sub.job_id))
    assert 0 < ttl <= 60


async def test_submit_refuses_an_id_taken_before_the_call_or_earlier_in_it(queue: Queue) -> None:
    """submit.lua asks once per call whether any of its ids is taken, and each job's own key
    only when one is: an id that existed before the call and an id given twice in one call
    are both answered EXISTS (the first of the two created, its document unchanged), with
    the fresh ids around them created, also in a call where no id was taken before it."""
    shard = 3
    old, fresh, twice = (queue.keys.new_id(shard) for _ in range(3))
    spec = JobSpec(type="echo", payload={"n": 1})

    async def submit(*ids: str) -> list[tuple[Code, str, bytes]]:
        items = [queue.produce.prepare(spec, "t1", job_id=i) for i in ids]
        reply = await queue.scripts.call(*submit_call(shard, items, 60_000))
        return [(o.code, o.job_id, o.doc) for o in parse_submit(reply)]

    ((code, _, old_doc),) = await submit(old)
    assert code is Code.OK
    out = await submit(fresh, old, twice, twice)
    assert [(c, i) for c, i, _ in out] == [
        (Code.OK, fresh), (Code.EXISTS, old), (Code.OK, twice), (Code.EXISTS, twice),
    ]  # fmt: skip
    assert out[1][2] == old_doc and out[3][2] == out[2][2]
    # no id taken before the call (none is looked up alone): the repeated one is still found
    more = [queue.keys.new_id(shard) for _ in range(3)]
    out = await submit(more[0], more[1], more[1], more[2])
    assert [c for c, _, _ in out] == [Code.OK, Code.OK, Code.EXISTS, Code.OK]
    for job_id in (fresh, twice, *more):
        assert (await queue.status(job_id)).state is State.QUEUED


async def test_worker_writes_are_refused_unless_they_hold_the_lease(queue: Queue) -> None:
    sub = await queue.submit("echo", None)
    job = await claim(queue, sub.job_id)
    assert await complete(queue, job, version=job.lease_version - 1) is Code.VERSION_CONFLICT
    assert await complete(queue, job, worker="intruder") is Code.NOT_OWNER
    ghost = msgspec.structs.replace(job, id=queue.keys.new_id(queue.keys.shard_of(job.id)))
    assert await complete(queue, ghost) is Code.NOT_FOUND
    assert (await queue.status(sub.job_id)).version == 2  # nothing applied
    assert await complete(queue, job) is Code.OK
    assert await complete(queue, job) is Code.WRONG_STATE
    assert (await heartbeat(queue, job))[0] is Code.WRONG_STATE


async def test_delayed_job_is_scheduled_then_promoted(queue: Queue) -> None:
    sub = await queue.submit("echo", None, delay=3600)
    status = sub.status
    assert status.state is State.SCHEDULED and status.run_at is not None
    shard = queue.keys.shard_of(sub.job_id)
    assert (await promote(queue, shard)).moved == 0  # not due yet
    assert (await queue.status(sub.job_id)).state is State.SCHEDULED
    await make_due(queue, sub.job_id)
    r = await promote(queue, shard)
    assert r.moved == 1 and r.next_ms == -1
    assert (await queue.status(sub.job_id)).state is State.QUEUED
    assert await history(queue, sub.job_id) == [("", "scheduled", 1), ("scheduled", "queued", 2)]


async def test_run_at_is_rendered_anew_when_a_script_moved_it_behind_the_cache(
    queue: Queue,
) -> None:
    """The rendered run_at is cached in the job hash ('t': '<run_at ms>|<ISO>'); a script that
    moves run_at without touching the cache (a jobtier of another version during a rolling
    deploy) must not leave the old date in the documents."""
    sub = await queue.submit("echo", None, delay=3600)
    assert sub.status.run_at is not None
    moved = datetime(2031, 5, 6, 7, 8, 9, 123_000, tzinfo=UTC)
    assert sub.status.run_at != "2031-05-06T07:08:09.123Z"
    key = queue.keys.job(sub.job_id)
    values = cast(bytes, await queue.redis.hget(key, "t")).split(b" ")
    values[job_format.T_FIELDS.index("run_at")] = str(int(moved.timestamp() * 1000)).encode()
    await queue.redis.hset(key, "t", b" ".join(values))
    cancelled = await queue.cancel(sub.job_id)
    assert cancelled.state is State.CANCELLED and cancelled.run_at == "2031-05-06T07:08:09.123Z"
    assert (await queue.status(sub.job_id)).run_at == cancelled.run_at


async def test_retryable_failure_schedules_a_retry_then_dead_letters(queue: Queue) -> None:
    sub = await queue.submit("flaky", None, max_attempts=2)
    job = await claim(queue, sub.job_id)
    before = time.time()
    code, state = await fail(queue, job, delay_ms=5000)
    assert (code, state) == (Code.OK, b"scheduled")
    status = await queue.status(sub.job_id)
    assert (
        status.state is State.SCHEDULED
        and status.error is not None
        and status.error.message == "boom"
    )
    assert status.run_at is not None
    run_at = datetime.fromisoformat(status.run_at).timestamp()
    assert before + 4.9 <= run_at <= time.time() + 5.1
    await make_due(queue, sub.job_id)
    await promote(queue, queue.keys.shard_of(sub.job_id))
    job2 = await claim(queue, sub.job_id)
    assert job2.attempt == 2 and job2.lease_version > job.lease_version
    assert (
        await complete(queue, job) is Code.VERSION_CONFLICT
    )  # the first attempt's writer is stale
    code, state = await fail(queue, job2, delay_ms=5000)
    assert (code, state) == (Code.OK, b"failed")  # attempts exhausted
    dead = await queue.jobs.dead_letters()
    assert [d.id for d in dead] == [sub.job_id]
    assert dead[0].state is State.FAILED


async def test_non_retryable_failure_goes_straight_to_dead_letters(queue: Queue) -> None:
    sub = await queue.submit("flaky", None, max_attempts=5)
    job = await claim(queue, sub.job_id)
    assert await fail(queue, job, delay_ms=-1) == (Code.OK, b"failed")
    assert (await queue.status(sub.job_id)).attempt == 1


async def test_replay_resets_attempts(queue: Queue) -> None:
    sub = await queue.submit("flaky", None, max_attempts=1)
    job = await claim(queue, sub.job_id)
    await fail(queue, job, delay_ms=0)
    replayed = await queue.jobs.replay(sub.job_id)
    assert replayed.state is State.QUEUED and replayed.attempt == 0 and replayed.error is None
    assert await queue.jobs.dead_letters() == []
    assert await queue.redis.ttl(queue.keys.job(sub.job_id)) == -1  # no longer expiring
    with pytest.raises(TransitionRefused) as again:
        await queue.jobs.replay(sub.job_id)
    assert again.value.code is Code.WRONG_STATE
    job = await claim(queue, sub.job_id)
    assert job.attempt == 1


async def test_replay_of_unknown_job(queue: Queue) -> None:
    with pytest.raises(JobNotFound):
        await queue.jobs.replay(queue.keys.new_id(0))


async def test_expired_lease_requeues_or_dead_letters(queue: Queue) -> None:
    sub = await queue.submit("echo", None, max_attempts=2)
    shard = queue.keys.shard_of(sub.job_id)
    job = await claim(queue, sub.job_id)
    assert (await reclaim(queue, shard)).moved == 0  # lease still valid
    await expire_lease(queue, sub.job_id)
    r = await reclaim(queue, shard)
    assert (r.moved, r.dead) == (1, 0)
    status = await queue.status(sub.job_id)
    assert status.state is State.QUEUED and status.error is not None
    assert status.error.type == "LeaseExpired" and status.worker is None
    assert await complete(queue, job) is Code.WRONG_STATE  # the dead worker's late write
    job2 = await claim(queue, sub.job_id, worker="worker-b")
    assert await complete(queue, job) is Code.VERSION_CONFLICT
    await expire_lease(queue, sub.job_id)
    r = await reclaim(queue, shard)
    assert (r.moved, r.dead) == (0, 1)
    assert (await queue.status(sub.job_id)).state is State.FAILED
    assert await complete(queue, job2, worker="worker-b") is Code.WRONG_STATE


async def test_heartbeat_extends_lease_and_records_progress(queue: Queue) -> None:
    sub = await queue.submit("echo", None)
    shard = queue.keys.shard_of(sub.job_id)
    job = await claim(queue, sub.job_id)
    await expire_lease(queue, sub.job_id)  # overdue: only the heartbeat can save it now
    assert await heartbeat(queue, job, progress=b"0.5") == (Code.OK, 0)
    assert (await reclaim(queue, shard)).moved == 0  # the heartbeat pushed the deadline out
    status = await queue.status(sub.job_id)
    assert status.progress == 0.5 and status.version == 3 and status.state is State.RUNNING
    assert await heartbeat(queue, job, progress=b"0.5") == (Code.OK, 0)
    assert (await queue.status(sub.job_id)).version == 3  # unchanged progress: no new version
    assert (await heartbeat(queue, job, worker="other"))[0] is Code.NOT_OWNER


async def test_cancel_queued_and_scheduled(queue: Queue) -> None:
    queued = await queue.submit("echo", None)
    later = await queue.submit("echo", None, delay=60)
    for sub in (queued, later):
        status = await queue.cancel(sub.job_id)
        assert status.state is State.CANCELLED and status.version == 2
    stats = await queue.admin.stats()
    assert stats["total"]["queued"] == 0 and stats["total"]["scheduled"] == 0
    shard = queue.keys.shard_of(queued.job_id)
    assert await queue.redis.llen(queue.keys.ready(shard, "default", "normal", "default")) == 0
    assert await queue.redis.llen(queue.keys.ring(shard, "default", "normal")) == 0
    assert await queue.redis.zcard(queue.keys.sched(queue.keys.shard_of(later.job_id))) == 0
    with pytest.raises(TransitionRefused) as refused:
        await queue.cancel(queued.job_id)
    assert refused.value.code is Code.WRONG_STATE
    assert await queue.admin.waiting_by_tenant() == {"default": 0}


async def test_cancel_running_is_a_request_the_worker_acts_on(queue: Queue) -> None:
    sub = await queue.submit("echo", None)
    job = await claim(queue, sub.job_id)
    status = await queue.cancel(sub.job_id)
    assert status.state is State.RUNNING and status.cancel_requested and status.version == 3
    assert (await queue.cancel(sub.job_id)).version == 3  # asking twice changes nothing
    assert await heartbeat(queue, job) == (Code.OK, 1)
    assert await stopped(queue, job) == (Code.OK, b"cancelled")
    assert (await queue.status(sub.job_id)).state is State.CANCELLED


async def test_cancel_running_loses_to_a_success_that_comes_first(queue: Queue) -> None:
    sub = await queue.submit("echo", None)
    job = await claim(queue, sub.job_id)
    await queue.cancel(sub.job_id)
    assert await complete(queue, job) is Code.OK
    status = await queue.status(sub.job_id)
    assert status.state is State.SUCCEEDED and status.cancel_requested


async def test_release_on_shutdown_requeues_without_counting_the_attempt(queue: Queue) -> None:
    sub = await queue.submit("echo", None)
    job = await claim(queue, sub.job_id)
    assert await stopped(queue, job) == (Code.OK, b"queued")
    status = await queue.status(sub.job_id)
    assert status.state is State.QUEUED and status.attempt == 0
    assert (await claim(queue, sub.job_id)).attempt == 1


async def test_another_tenant_sees_nothing(queue: Queue) -> None:
    sub = await queue.submit("echo", None, tenant="acme")
    with pytest.raises(JobNotFound):
        await queue.status(sub.job_id, tenant="globex")
    with pytest.raises(JobNotFound):
        await queue.cancel(sub.job_id, tenant="globex")
    assert (await queue.status(sub.job_id, tenant="acme")).state is State.QUEUED
    assert (await queue.status(sub.job_id)).version == 1  # the refused cancel changed nothing


async def test_idempotent_submit(queue: Queue) -> None:
    first = await queue.submit("echo", {"a": 1}, idempotency_key="order-1")
    again = await queue.submit("echo", {"a": 1}, idempotency_key="order-1")
    assert first.created and not again.created and again.job_id == first.job_id
    (conflict,) = await queue.submit_many(
        [JobSpec(type="echo", payload={"a": 2}, idempotency_key="order-1")]
    )
    assert isinstance(conflict, IdempotencyConflict) and conflict.job_id == first.job_id
    with pytest.raises(IdempotencyConflict):
        await queue.submit("echo", {"a": 2}, idempotency_key="order-1")
    other_tenant = await queue.submit("echo", {"a": 2}, idempotency_key="order-1", tenant="t2")
    assert other_tenant.created and other_tenant.job_id != first.job_id


async def test_every_change_bumps_the_version_and_is_logged(queue: Queue) -> None:
    sub = await queue.submit("echo", None, max_attempts=3)
    shard = queue.keys.shard_of(sub.job_id)
    job = await claim(queue, sub.job_id)
    await heartbeat(queue, job, progress=b'{"step":1}')
    await fail(queue, job, delay_ms=0)
    await make_due(queue, sub.job_id)
    await promote(queue, shard)
    job = await claim(queue, sub.job_id)
    await queue.cancel(sub.job_id)
    await stopped(queue, job)
    steps = await history(queue, sub.job_id)
    assert [v for _, _, v in steps] == list(range(1, len(steps) + 1))
    assert [(f, t) for f, t, _ in steps] == [
        ("", "queued"),
        ("queued", "running"),
        ("running", "running"),
        ("running", "scheduled"),
        ("scheduled", "queued"),
        ("queued", "running"),
        ("running", "running"),
        ("running", "cancelled"),
    ]
    assert (await queue.status(sub.job_id)).version == len(steps)


async def test_rendered_document_has_exactly_the_status_fields(queue: Queue) -> None:
    import orjson

    sub = await queue.submit("echo", {"a": 1}, delay=30)
    # a job without dependencies renders no "dependencies" member: a plain job's document
    # (stored, logged, published) costs nothing for flows; result_url appears only for a
    # result kept outside Redis (test_results.py), checkpoint only once a task saved one
    # (test_checkpoints.py)
    plain = set(JobStatus.__struct_fields__) - {"dependencies", "result_url", "checkpoint"}
    assert set(orjson.loads(sub.doc)) == plain
    dependent = await queue.submit("echo", None, depends_on=[sub.job_id])
    assert set(orjson.loads(dependent.doc)) == plain | {"dependencies"}


async def test_published_event_carries_the_document(queue: Queue) -> None:
    from jobtier.store.subscriber import ShardSubscriber

    got: list[tuple[bytes, bytes]] = []
    sub_ready = ShardSubscriber(
        queue.redis,
        [queue.keys.events(s) for s in range(queue.keys.shards)],
        lambda c, d: got.append((c, d)),
    )
    await sub_ready.start()
    try:
        sub = await queue.submit("echo", None, tenant="acme")
        await wait_for(lambda: bool(got))
        channel, data = got[0]
        header, doc = data.split(b"\n", 1)
        assert header == f"{sub.job_id} 1 acme".encode()
        assert doc == sub.doc
        assert channel == queue.keys.events(queue.keys.shard_of(sub.job_id)).encode()
        assert isinstance(decode_status(doc), JobStatus)
    finally:
        await sub_ready.stop()


async def test_a_large_batch_goes_in_pipelines_sent_together(queue: Queue) -> None:
    """From SPREAD_FROM jobs, a batch submit's shard calls go in four pipelines, every one sent
    before the first one's replies are read (Scripts.call_spread), and each job's outcome still
    comes back in its place; a smaller batch goes in one pipeline."""
    events: list[tuple[str, int]] = []
    call_many = queue.scripts.call_many

    async def recording(calls: Any) -> list[Any]:
        events.append(("start", len(calls)))
        try:
            return await call_many(calls)
        finally:
            events.append(("end", len(calls)))

    queue.scripts.call_many = recording  # type: ignore[method-assign]
    n = SPREAD_FROM * 2
    submitted = await queue.submit_many([JobSpec(type="echo", payload={"i": i}) for i in range(n)])
    shards = {queue.keys.shard_of(s.job_id) for s in submitted}
    starts = [calls for kind, calls in events if kind == "start"]
    per = -(-len(shards) // 4)  # calls a pipeline (engine/queue.py submit_items)
    assert len(starts) == -(-len(shards) // per) > 1
    assert sum(starts) == len(shards)  # one call per shard, each in one of the pipelines
    assert [kind for kind, _ in events[: len(starts)]] == ["start"] * len(starts)
    for i, sub in enumerate(submitted):
        assert (
            isinstance(sub, Submitted) and sub.created and decode_status(sub.doc).id == sub.job_id
        )
        payload = await queue.redis.hget(queue.keys.job(sub.job_id), "payload")
        assert payload is not None
        assert msgspec.json.decode(payload) == {"i": i}

    events.clear()
    small = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(10)])
    assert [kind for kind, _ in events] == ["start", "end"] and all(
        isinstance(s, Submitted) and s.created for s in small
    )


async def test_a_spread_call_that_fails_leaves_the_others_run(queue: Queue) -> None:
    """call_spread raises the error of a refused call once every pipeline has run: the calls
    beside it, in its pipeline and in the others, are made."""
    items: dict[int, SubmitItem] = {}
    for i in range(40):
        item = queue.produce.prepare(JobSpec(type="echo", payload=i), "default")
        items.setdefault(queue.keys.shard_of(item.job_id), item)
    calls = [submit_call(s, [item], 60_000) for s, item in items.items()]
    broken = ("submit", calls[0][1], ["60000"])  # no job count: the script fails
    with pytest.raises(ResponseError):
        await queue.scripts.call_spread([broken, *calls], 1 if len(calls) < 3 else 2)
    for item in items.values():
        assert (await queue.status(item.job_id)).state is State.QUEUED


# --- a claim sent twice (the client library resends a call whose reply was lost) ----------
async def test_a_claim_resent_with_its_token_answers_the_same_jobs_again(queue: Queue) -> None:
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(40)])
    per_shard = Counter(queue.keys.shard_of(s.job_id) for s in subs)
    shard, ready = per_shard.most_common(1)[0]
    assert ready >= 7
    scripts = queue.scripts
    first = await scripts.claim(shard, W, 3, 30_000, token="t-1")
    assert len(first.jobs) == 3
    versions = {j.id: (await queue.status(j.id)).version for j in first.jobs}

    again = await scripts.claim(shard, W, 3, 30_000, token="t-1")
    assert again == first  # the first answer: same jobs, leases, attempts, clock
    # nothing changed: no transition, no second attempt
    for job in first.jobs:
        status = await queue.status(job.id)
        assert status.version == versions[job.id] and status.attempt == 1
        assert status.state is State.RUNNING and status.worker == W

    other = await scripts.claim(shard, W, 3, 30_000, token="t-2")  # a new token: new jobs
    assert len(other.jobs) == 3
    assert not {j.id for j in other.jobs} & {j.id for j in first.jobs}

    # a job no longer held under that lease (completed here) is not answered again
    assert await complete(queue, first.jobs[0]) is Code.OK
    after = await scripts.claim(shard, W, 3, 30_000, token="t-1")
    assert after.jobs == first.jobs[1:]
    # nor under another worker's name: the token is the claim's, not a way into its jobs
    assert (await scripts.claim(shard, "worker-b", 3, 30_000, token="t-1")).jobs == []


async def test_a_claim_token_kept_past_its_lease_claims_anew(queue: Queue) -> None:
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(40)])
    shard = queue.keys.shard_of(subs[0].job_id)
    kept = queue.keys.base(shard) + "ct:t-short"
    first = await queue.scripts.claim(shard, W, 2, 200, token="t-short")
    assert len(first.jobs) == 2
    assert 0 < await queue.redis.pttl(kept) <= 200  # kept for the claim's lease

    async def gone() -> bool:
        return await queue.redis.exists(kept) == 0

    await wait_for(gone, timeout=5)
    late = await queue.scripts.claim(shard, W, 2, 30_000, token="t-short")
    assert len(late.jobs) == 2 and not {j.id for j in late.jobs} & {j.id for j in first.jobs}


async def test_a_claim_without_a_token_or_that_leased_nothing_keeps_nothing(
    queue: Queue, redis: RedisClient
) -> None:
    sub = await queue.submit("echo", None)
    shard = queue.keys.shard_of(sub.job_id)
    base = queue.keys.base(shard)
    nothing = [("nothing-here", -1)]
    empty = await queue.scripts.claim(shard, W, 5, 30_000, nothing, token="t-empty")
    assert empty.jobs == [] and await queue.redis.exists(base + "ct:t-empty") == 0
    # resent when there is work, a claim that leased nothing claims it
    resent = await queue.scripts.claim(shard, W, 5, 30_000, token="t-empty")
    assert [j.id for j in resent.jobs] == [sub.job_id]
    sub2 = await queue.submit("echo", None)
    shard2 = queue.keys.shard_of(sub2.job_id)
    kept = queue.keys.base(shard2) + "ct:*"
    before = await redis.keys(kept)
    untokened = await queue.scripts.claim(shard2, W, 5, 30_000, token="")
    assert [j.id for j in untokened.jobs] == [sub2.job_id]
    assert await redis.keys(kept) == before


async def test_worker_writes_resent_after_they_ran_are_refused_or_harmless(queue: Queue) -> None:
    """What a resend of the other worker transitions does: a completion or a failure that ran
    is refused as stale (its lease is gone), a heartbeat extends the same lease again."""
    a = await queue.submit("echo", None)
    job_a = await claim(queue, a.job_id)
    b = await queue.submit("echo", None, max_attempts=3)
    job_b = await claim(queue, b.job_id)
    assert (await heartbeat(queue, job_a))[0] is Code.OK
    assert (await heartbeat(queue, job_a))[0] is Code.OK
    assert await complete(queue, job_a) is Code.OK
    assert await complete(queue, job_a) is Code.WRONG_STATE
    assert (await fail(queue, job_b, 60_000))[0] is Code.OK
    assert (await fail(queue, job_b, 60_000))[0] is Code.WRONG_STATE
    assert (await queue.status(b.job_id)).attempt == 1


async def test_a_calls_transitions_are_one_log_entry_of_at_most_a_hundred(queue: Queue) -> None:
    """A script call's transitions go to the log in one entry ('n' of them, each one's
    fields named with its place), one transition in an entry of its own fields as before,
    and a call of more than 100 in entries of 100: every transition in the order made."""
    shard = 0
    items = [
        SubmitItem(queue.keys.new_id(shard), "t1", "echo", "normal", b"%d" % i, 3, 0, 0, "", "")
        for i in range(250)
    ]
    await queue.scripts.call(*submit_call(shard, items, 60_000))
    raw = cast(list[tuple[bytes, dict[bytes, bytes]]], await queue.redis.xrange(queue.keys.log(0)))
    assert [f[b"n"] for _, f in raw] == [b"100", b"100", b"50"]
    assert [k for k in raw[2][1] if k.endswith(b"50")] == [
        b"d50",
        b"tn50",
        b"fr50",
        b"w50",
        b"pv50",
        b"p50",
    ]
    parts = await logged(queue.redis, queue.keys.log(0))
    assert [decode_status(p[b"d"]).id for p in parts] == [i.job_id for i in items]
    assert [p[b"p"] for p in parts] == [i.payload for i in items]
    assert {(p[b"fr"], p[b"w"], p[b"pv"], p[b"tn"]) for p in parts} == {(b"", b"api", b"0", b"t1")}

    job = await claim(queue, items[0].job_id)
    assert await complete(queue, job) is Code.OK
    # one job a call: entries of one transition, their fields as they always were
    last = cast(
        list[tuple[bytes, dict[bytes, bytes]]],
        await queue.redis.xrevrange(queue.keys.log(0), count=1),
    )
    assert (
        b"n" not in last[0][1] and last[0][1][b"fr"] == b"running" and last[0][1][b"r"] == b'"done"'
    )
    assert await history(queue, items[0].job_id) == [
        ("", "queued", 1),
        ("queued", "running", 2),
        ("running", "succeeded", 3),
    ]
