"""Flows on the real scripts, on the single Redis and the Redis Cluster (``contract``):
dependencies, fan-in across shards, chains, nesting, failure propagation, cancel of a parent,
idempotent flow submits, refused flows, the submit cut short, and the resolver's hand-offs
applied more than once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import msgspec
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier.config import Settings
from jobtier.core.errors import IdempotencyConflict, InvalidRequest
from jobtier.core.model import ClaimedJob, FlowJob, JobSpec, State
from jobtier.engine.queue import Queue
from jobtier.flows import chain, fan_in
from jobtier.flows.resolver import Resolver
from jobtier.store.calls import fail_call, parse_pairs, promote_call, reclaim_call
from tests.fixtures.engine import wait_for
from tests.fixtures.redis import StreamEntries, logged
from tests.flows_helpers import run_flows, statuses, transitions
from tests.integration.test_transitions import complete
from tests.tasks import registry

pytestmark = pytest.mark.contract


@pytest.fixture
async def fq(settings: Settings) -> AsyncIterator[Queue]:
    """A queue that knows the test tasks (their compensations among them)."""
    q = await Queue.connect(settings.replace(flow_link_timeout_seconds=0.3), registry)
    yield q
    await q.close()


def job(type: str, payload: Any = None, **kw: Any) -> FlowJob:
    return FlowJob(type=type, payload=payload, **kw)


async def claim(queue: Queue, job_id: str, lease_ms: int = 30_000) -> ClaimedJob:
    """Claim exactly this job as worker-a: the oldest ready job of its shard."""
    batch = await queue.scripts.claim(queue.keys.shard_of(job_id), "worker-a", 1, lease_ms)
    assert [j.id for j in batch.jobs] == [job_id]
    return batch.jobs[0]


async def result(queue: Queue, job_id: str) -> Any:
    return (await queue.result(job_id))[1]


async def job_keys(queue: Queue) -> int:
    """Job hashes in Redis (on every node of a cluster)."""
    total = 0
    for shard in range(queue.keys.shards):
        async for _ in queue.redis.scan_iter(match=queue.keys.job_in(shard, "*"), count=1000):
            total += 1
    return total


# --- dependencies ------------------------------------------------------------------------------
async def test_a_dependent_waits_and_runs_with_its_dependencies_results(fq: Queue) -> None:
    a = await fq.submit("echo", {"from": "a"})
    b = await fq.submit("echo", {"from": "b"})
    c = await fq.submit("collect", "c", depends_on=[a.job_id, b.job_id])
    doc = c.status
    assert doc.state is State.WAITING
    assert doc.dependencies is not None and (doc.dependencies.total, doc.dependencies.done) == (
        2,
        0,
    )
    stats = await fq.admin.stats()
    assert stats["total"]["waiting"] == 1 and stats["total"]["queued"] == 2
    assert sum((await fq.admin.waiting_by_tenant()).values()) == 3  # waiting counts as waiting

    # one dependency done: the document moves (a new version), the job still waits
    job_a = await claim(fq, a.job_id)
    await complete(fq, job_a, result=b'{"from":"a"}')
    await Resolver(fq.store).drain()
    mid = await fq.status(c.job_id)
    assert mid.state is State.WAITING and mid.version > doc.version
    assert mid.dependencies is not None and (mid.dependencies.done, mid.dependencies.failed) == (
        1,
        0,
    )

    await run_flows(fq)
    final, out = await fq.result(c.job_id)
    assert final.state is State.SUCCEEDED
    assert out["dependencies"] == {
        a.job_id: ["succeeded", {"from": "a"}, None],
        b.job_id: ["succeeded", {"from": "b"}, None],
    }
    assert list(out["dependencies"]) == [a.job_id, b.job_id]  # in the order given
    assert out["previous"] == {"from": "b"}
    assert await transitions(fq, c.job_id) == [
        ("", "waiting"),
        ("waiting", "queued"),
        ("queued", "running"),
        ("running", "succeeded"),
    ]
    deps = await fq.jobs.dependencies(c.job_id)
    assert [(d.id, d.state, d.child) for d in deps] == [
        (a.job_id, "succeeded", False),
        (b.job_id, "succeeded", False),
    ]
    assert (await fq.admin.stats())["total"]["waiting"] == 0


async def test_a_dependency_finished_before_the_dependent_is_linked_at_once(fq: Queue) -> None:
    done = await fq.submit("echo", 1)
    failed = await fq.submit("fail", {"fatal": True})
    await run_flows(fq)
    ok = await fq.submit("collect", None, depends_on=[done.job_id])
    bad = await fq.submit("collect", None, depends_on=[failed.job_id])
    await run_flows(fq)
    assert (await fq.status(ok.job_id)).state is State.SUCCEEDED
    cancelled = await fq.status(bad.job_id)
    assert cancelled.state is State.CANCELLED
    assert cancelled.error is not None and cancelled.error.type == "DependencyFailed"
    assert failed.job_id in cancelled.error.message and "Fatal" in cancelled.error.message


async def test_unknown_or_foreign_dependencies_are_refused_and_change_nothing(fq: Queue) -> None:
    mine = await fq.submit("echo", 1, tenant="acme")
    before = await job_keys(fq)
    for deps, field in (
        ([fq.keys.new_id()], "depends_on"),  # nobody's
        ([mine.job_id], "depends_on"),  # another tenant's: refused exactly the same way
        (["not-an-id"], "depends_on"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            await fq.submit("echo", None, depends_on=deps, tenant="globex")
        assert refused.value.field == field
    with pytest.raises(InvalidRequest) as refused:
        await fq.submit_many(
            [JobSpec(type="echo"), JobSpec(type="echo", depends_on=[fq.keys.new_id()])],
            tenant="globex",
        )
    assert refused.value.field == "jobs[1].depends_on"
    assert await job_keys(fq) == before


# --- flows -------------------------------------------------------------------------------------
async def test_a_diamond_resolves_its_end_once(fq: Queue) -> None:
    flow = [
        job("echo", "top", ref="a"),
        job("add", 1, ref="b", after=["a"]),
        job("echo", "right", ref="c", after=["a"]),
        job("collect", "end", ref="d", after=["b", "c"]),
    ]
    # a's result is not a number: b fails, and d (cancel on failure) is cancelled
    sub = await fq.submit_flow(flow)
    await run_flows(fq)
    assert [s.state for s in await statuses(fq, sub.ids)] == [
        State.SUCCEEDED,
        State.FAILED,
        State.SUCCEEDED,
        State.CANCELLED,
    ]
    flow[0] = job("echo", 41, ref="a")
    sub = await fq.submit_flow(flow)
    await run_flows(fq)
    _, b, c, d = sub.ids
    out = await result(fq, d)
    assert out["dependencies"] == {b: ["succeeded", 42, None], c: ["succeeded", "right", None]}
    for job_id in (b, c, d):
        assert (await transitions(fq, job_id)).count(("waiting", "queued")) == 1


async def test_a_fan_in_across_every_shard_gives_the_parent_every_result(fq: Queue) -> None:
    children = [job("echo", i) for i in range(200)]
    flow = fan_in(job("collect", "parent"), children)
    sub = await fq.submit_flow(flow)
    *kids, parent = sub.ids
    assert {fq.keys.shard_of(k) for k in kids} == set(range(fq.keys.shards))
    first = await fq.status(parent)
    assert first.dependencies is not None and first.dependencies.total == 200
    await run_flows(fq)
    status, out = await fq.result(parent)
    assert status.state is State.SUCCEEDED and status.dependencies is not None
    assert (status.dependencies.done, status.dependencies.failed) == (200, 0)
    assert [v[1] for v in out["dependencies"].values()] == list(range(200))
    assert list(out["dependencies"]) == kids
    assert (await transitions(fq, parent)).count(("waiting", "queued")) == 1
    assert all(d.child for d in await fq.jobs.dependencies(parent))


async def test_a_chain_passes_each_result_to_the_next_step(fq: Queue) -> None:
    sub = await fq.submit_flow(chain(job("add", 1), job("add", 2), job("add", 3), job("add", 4)))
    await run_flows(fq)
    assert [await result(fq, i) for i in sub.ids] == [1, 3, 6, 10]


async def test_nested_flows(fq: Queue) -> None:
    inner = fan_in(job("collect", "inner"), [job("echo", "x"), job("echo", "y")])
    flow = fan_in(job("collect", "outer"), [inner, chain(job("add", 1), job("add", 1))])
    sub = await fq.submit_flow(flow)
    await run_flows(fq)
    x, y, inner_id, _, two, outer = sub.ids
    out = await result(fq, outer)
    assert list(out["dependencies"]) == [inner_id, two]
    inner_out = out["dependencies"][inner_id][1]
    assert inner_out["dependencies"] == {x: ["succeeded", "x", None], y: ["succeeded", "y", None]}
    assert out["dependencies"][two][1] == 2


async def test_a_failure_cancels_every_job_downstream_with_its_reason(fq: Queue) -> None:
    sub = await fq.submit_flow(
        chain(job("fail", {"fatal": True}), job("echo", "b"), job("echo", "c"))
    )
    await run_flows(fq)
    a, b, c = await statuses(fq, sub.ids)
    assert a.state is State.FAILED and b.state is State.CANCELLED and c.state is State.CANCELLED
    assert b.error is not None and b.error.type == "DependencyFailed"
    assert a.id in b.error.message and "asked to fail for good" in b.error.message
    assert c.error is not None and c.error.type == "DependencyCancelled" and b.id in c.error.message
    assert (await fq.admin.stats())["total"]["waiting"] == 0


async def test_on_dependency_failure_run_runs_the_dependent_with_the_errors(fq: Queue) -> None:
    sub = await fq.submit_flow(
        [
            job("fail", {"fatal": True}, ref="bad"),
            job("echo", "good", ref="good"),
            job("collect", "end", after=["bad", "good"], on_dependency_failure="run"),
        ]
    )
    await run_flows(fq)
    bad, good, end = sub.ids
    status, out = await fq.result(end)
    assert status.state is State.SUCCEEDED
    assert status.dependencies is not None and status.dependencies.failed == 1
    assert out["dependencies"] == {
        bad: ["failed", None, "Fatal"],
        good: ["succeeded", "good", None],
    }


async def test_a_cancelled_dependent_still_learns_how_its_dependencies_ended(fq: Queue) -> None:
    """Its dependencies read from Redis showed them pending for good once it was cancelled:
    the hand-offs that came after were refused whole."""
    a = await fq.submit("echo", {"from": "a"})
    b = await fq.submit("echo", {"from": "b"})
    c = await fq.submit("collect", "c", depends_on=[a.job_id, b.job_id])
    cancelled = await fq.cancel(c.job_id)
    await run_flows(fq)
    ended = await fq.status(c.job_id)
    assert ended.state is State.CANCELLED and ended.dependencies is not None
    assert (ended.dependencies.done, ended.dependencies.failed) == (0, 0)  # as it was cancelled
    deps = await fq.jobs.dependencies(c.job_id)
    assert [(d.id, d.state, d.result) for d in deps] == [
        (a.job_id, "succeeded", {"from": "a"}),
        (b.job_id, "succeeded", {"from": "b"}),
    ]
    assert ended.version == cancelled.version  # the job itself did not move


async def test_cancelling_a_dependency_cancels_its_dependent(fq: Queue) -> None:
    a = await fq.submit("echo", 1)
    b = await fq.submit("echo", 2, depends_on=[a.job_id])
    await fq.cancel(a.job_id)
    await Resolver(fq.store).drain()
    status = await fq.status(b.job_id)
    assert status.state is State.CANCELLED
    assert status.error is not None and status.error.type == "DependencyCancelled"


async def test_a_dependency_that_fails_after_a_cancel_request_is_cancelled_for_its_dependents(
    fq: Queue,
) -> None:
    """A pending cancel request wins over the failure (no retry, no dead letter): the job
    ends cancelled, so it makes no compensation and its dependents learn of a cancel."""
    a = await fq.submit("charge", {"fail": True})  # attempts left, and a compensation
    b = await fq.submit("collect", "b", depends_on=[a.job_id], on_dependency_failure="run")
    started = await claim(fq, a.job_id)
    requested = await fq.cancel(a.job_id)
    assert requested.state is State.RUNNING and requested.cancel_requested
    reply = await fq.scripts.call(
        *fail_call(
            fq.keys.shard_of(a.job_id),
            "worker-a",
            60,
            [(a.job_id, started.lease_version, b'{"type":"E","message":"no"}', 0)],
        )
    )
    assert parse_pairs(reply)[0][1] == b"cancelled"
    ended = await fq.status(a.job_id)
    assert ended.state is State.CANCELLED and ended.error is not None
    assert ended.error.type == "Cancelled"
    assert await fq.jobs.compensation_of(a.job_id) is None
    await Resolver(fq.store).drain()
    (dep,) = await fq.jobs.dependencies(b.job_id)
    assert dep.state == "cancelled" and dep.error is not None and dep.error.type == "Cancelled"
    assert (await fq.status(b.job_id)).state is State.QUEUED  # "run": it runs all the same


async def test_cancelling_a_parent_cancels_the_children_that_have_not_started(fq: Queue) -> None:
    grandchildren = [job("echo", "g1"), job("echo", "g2")]
    flow = fan_in(
        job("collect", "parent"),
        [
            job("echo", "running"),
            job("echo", "queued"),
            fan_in(job("collect", "sub"), grandchildren),
        ],
    )
    sub = await fq.submit_flow(flow)
    running, queued, g1, g2, subparent, parent = sub.ids
    started = await claim(fq, running)
    outsider = await fq.submit("echo", "not a child", depends_on=[g1])  # waits for g1 too
    cancelled = await fq.cancel(parent)
    assert cancelled.state is State.CANCELLED
    await Resolver(fq.store).drain()
    states = {s.id: s for s in await statuses(fq, sub.ids)}
    assert states[running].state is State.RUNNING and not states[running].cancel_requested
    for child in (queued, subparent, g1, g2):  # the grandchildren through the sub-flow
        assert states[child].state is State.CANCELLED, child
        error = states[child].error
        assert error is not None
        assert error.type == "ParentCancelled"
    # a job that merely waits for a cancelled child learns it as any dependent does
    other = await fq.status(outsider.job_id)
    assert other.state is State.CANCELLED and other.error is not None
    assert other.error.type == "DependencyCancelled"
    # the running child finishes normally; the cancelled parent stays cancelled
    assert await complete(fq, started) == 0
    await Resolver(fq.store).drain()
    assert (await fq.status(running)).state is State.SUCCEEDED
    assert (await fq.status(parent)).state is State.CANCELLED
    assert (await fq.admin.stats())["total"]["waiting"] == 0


# --- idempotency and refusals -------------------------------------------------------------------
async def test_a_flow_submit_is_idempotent_with_its_key(fq: Queue) -> None:
    flow = fan_in(job("collect", "p"), [job("echo", i) for i in range(20)])
    first = await fq.submit_flow(flow, idempotency_key="nightly-7")
    again = await fq.submit_flow(flow, idempotency_key="nightly-7")
    assert first.created and not again.created
    assert again.ids == first.ids
    changed = fan_in(job("collect", "changed"), [job("echo", i) for i in range(20)])
    with pytest.raises(IdempotencyConflict):
        await fq.submit_flow(changed, idempotency_key="nightly-7")
    before = await job_keys(fq)
    await run_flows(fq)
    done = await fq.submit_flow(flow, idempotency_key="nightly-7")
    assert done.ids == first.ids and not done.created
    assert {s.state for s in await statuses(fq, done.ids)} == {State.SUCCEEDED}
    assert await job_keys(fq) == before  # nothing was made twice


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
async def test_a_flow_submit_cut_short_is_finished_by_its_repeat(fq: Queue, fail_at: int) -> None:
    """The connection drops before step ``fail_at`` of the submit (flows/submit.py): the
    client's repeat with the same key makes exactly the missing jobs and links."""
    flow = chain(job("add", 1), fan_in(job("collect", "p"), [job("add", 10), job("add", 20)]))
    flow.append(job("echo", "outside", depends_on=[(await fq.submit("echo", 0)).job_id]))
    real = fq.scripts.call_many
    step = 0

    async def dropping(calls: Any) -> Any:
        nonlocal step
        step += 1
        if step == fail_at:
            raise RedisConnectionError("connection dropped (test)")
        return await real(calls)

    fq.scripts.call_many = dropping  # type: ignore[method-assign]
    try:
        with pytest.raises(RedisConnectionError):
            await fq.submit_flow(flow, idempotency_key="cut-short")
    finally:
        del fq.scripts.call_many
    repeat = await fq.submit_flow(flow, idempotency_key="cut-short")
    assert repeat.created == (fail_at == 1)  # the head did not exist yet
    await run_flows(fq)
    outs = [await result(fq, i) for i in repeat.ids]
    assert outs[:3] == [1, 11, 21] and outs[4] == "outside"
    assert outs[3]["dependencies"] == {
        repeat.ids[1]: ["succeeded", 11, None],
        repeat.ids[2]: ["succeeded", 21, None],
    }
    for job_id in repeat.ids[1:]:  # each dependent was queued once, however it was linked
        assert (await transitions(fq, job_id)).count(("waiting", "queued")) == 1


async def test_a_dependent_whose_submit_died_is_linked_by_the_resolver(fq: Queue) -> None:
    """A submitter that dies after creating the dependents and before linking them: past the
    link deadline the resolver links them; a dependency that was never made cancels its
    dependent (DependencyMissing)."""
    existing = await fq.submit("echo", "there")
    real = fq.scripts.call_many

    async def dying(calls: Any) -> Any:
        if any(name == "link" for name, _, _ in calls):
            raise RedisConnectionError("the submitter died (test)")
        return await real(calls)

    fq.scripts.call_many = dying  # type: ignore[method-assign]
    try:
        with pytest.raises(RedisConnectionError):
            await fq.submit("collect", "linked late", depends_on=[existing.job_id])
        with pytest.raises(RedisConnectionError):  # dies before its children exist
            await fq.submit_flow(
                [
                    job("collect", "orphan", after=["kid"], depends_on=[existing.job_id]),
                    job("echo", "never made", ref="kid"),
                ]
            )
    finally:
        del fq.scripts.call_many
    stats = await fq.admin.stats()
    assert stats["total"]["waiting"] == 2
    resolver = Resolver(fq.store)

    async def all_settled() -> bool:
        await run_flows(fq, resolver)
        waiting: int = (await fq.admin.stats())["total"]["waiting"]
        return waiting == 0

    await wait_for(all_settled, timeout=30)  # past JOBTIER_FLOW_LINK_TIMEOUT_SECONDS (0.3 s)
    assert resolver.stats.relinked == 2
    assert not await fq.jobs.dead_letters()  # nothing failed
    by_payload = {}
    for shard in range(fq.keys.shards):
        for fields in await logged(fq.redis, fq.keys.log(shard)):
            doc = msgspec.json.decode(fields[b"d"])
            if doc["type"] == "collect":
                by_payload[doc["id"]] = doc
    states = sorted(d["state"] for d in by_payload.values())
    assert states == ["cancelled", "succeeded"]
    (orphan,) = [d for d in by_payload.values() if d["state"] == "cancelled"]
    assert orphan["error"]["type"] == "DependencyMissing"


async def test_bad_flows_are_refused_and_change_nothing(settings: Settings) -> None:
    q = await Queue.connect(settings.replace(max_flow_jobs=5), registry)
    try:
        before = await job_keys(q)
        cases: list[tuple[list[FlowJob], str]] = [
            (
                [job("echo", ref="a", after=["b"]), job("echo", ref="b", after=["a"])],
                "jobs[0].after",
            ),
            ([job("echo", ref="a", after=["a"])], "jobs[0].after"),
            ([job("echo", ref="a"), job("echo", after=["nope"])], "jobs[1].after"),
            ([job("echo", ref="a"), job("echo", ref="a")], "jobs[1].ref"),
            ([job("echo", depends_on=[q.keys.new_id()])], "jobs[0].depends_on"),
            ([job("echo") for _ in range(6)], "jobs"),
            ([], "jobs"),
            ([job("echo"), job("echo", priority="urgent")], "jobs[1].priority"),
        ]
        for flow, field in cases:
            with pytest.raises(InvalidRequest) as refused:
                await q.submit_flow(flow)
            assert refused.value.field == field, (flow, str(refused.value))
        assert "cycle" in str(await _refusal(q, cases[0][0]))
        assert await job_keys(q) == before
    finally:
        await q.close()


async def _refusal(q: Queue, flow: list[FlowJob]) -> InvalidRequest:
    try:
        await q.submit_flow(flow)
    except InvalidRequest as exc:
        return exc
    raise AssertionError("accepted")


# --- the resolver ------------------------------------------------------------------------------
async def test_a_handoff_applied_twice_changes_nothing(fq: Queue) -> None:
    a = await fq.submit("echo", 1)
    b = await fq.submit("echo", 2)
    c = await fq.submit("collect", None, depends_on=[a.job_id, b.job_id])
    job_a = await claim(fq, a.job_id)
    await complete(fq, job_a, result=b"1")
    shard = fq.keys.shard_of(a.job_id)
    entries = cast(StreamEntries, await fq.redis.xrange(fq.keys.flow(shard)))
    assert len(entries) == 1
    resolver = Resolver(fq.store)
    await resolver.consumer.setup()
    replay = [(shard, entry_id, fields) for entry_id, fields in entries]
    await resolver.apply(replay)
    once = await fq.status(c.job_id)
    await resolver.apply(replay)  # as a resolver taking over an unacknowledged hand-off does
    assert resolver.stats.applied == 1 and resolver.stats.repeated == 1
    twice = await fq.status(c.job_id)
    assert twice == once and twice.dependencies is not None and twice.dependencies.done == 1


async def test_a_malformed_handoff_is_set_aside_and_the_next_ones_resolve(fq: Queue) -> None:
    """A hand-off no resolver can apply (fields missing) is logged and acknowledged: it does
    not hold up the hand-offs after it."""
    a = await fq.submit("echo", 1)
    c = await fq.submit("collect", None, depends_on=[a.job_id])
    shard = fq.keys.shard_of(a.job_id)
    resolver = Resolver(fq.store)
    await resolver.consumer.setup()
    await fq.redis.xadd(fq.keys.flow(shard), {b"x": b"1"})  # no kind, source or targets
    await complete(fq, await claim(fq, a.job_id), result=b"1")
    await resolver.drain()
    assert resolver.stats.handoffs == 2 and resolver.stats.applied == 1
    assert (await fq.status(c.job_id)).state is State.QUEUED
    pending = await fq.redis.xpending(fq.keys.flow(shard), fq.keys.resolver_group())
    assert pending["pending"] == 0


async def test_handoffs_a_dead_resolver_took_are_taken_over(settings: Settings) -> None:
    q = await Queue.connect(settings.replace(resolver_claim_idle_seconds=0.2), registry)
    try:
        sub = await q.submit_flow(fan_in(job("collect"), [job("echo", i) for i in range(12)]))
        await _finish_ready(q)
        dead = Resolver(q.store, name="dead-resolver")
        await dead.consumer.setup()
        # it reads every hand-off and dies before applying any (nothing acknowledged)
        pipe = q.redis.pipeline(transaction=False)
        for shard in range(q.keys.shards):
            pipe.xreadgroup(dead.consumer.group, dead.name, {q.keys.flow(shard): ">"}, count=100)
        taken = sum(len(r[0][1]) for r in await pipe.execute() if r)
        assert taken == 12
        survivor = Resolver(q.store, name="survivor")

        async def parent_queued() -> bool:
            await survivor.run_once()
            return (await q.status(sub.ids[-1])).state is State.QUEUED

        await wait_for(parent_queued, timeout=20)
        assert survivor.stats.claimed == 12
        await run_flows(q)
        assert (await q.status(sub.ids[-1])).state is State.SUCCEEDED
    finally:
        await q.close()


async def _finish_ready(q: Queue) -> None:
    from tests.fixtures.engine import worker_for

    await worker_for(q, registry, burst=True).run()


# --- compensation ------------------------------------------------------------------------------
async def test_a_compensation_is_created_with_the_failure_itself(fq: Queue) -> None:
    ok = await fq.submit("charge", {"card": "good"})
    bad = await fq.submit("charge", {"card": "stolen", "fail": True}, max_attempts=1)
    retried = await fq.submit("charge", {"card": "retry", "fail": True})  # 2 attempts
    await run_flows(fq)
    assert (await fq.status(ok.job_id)).state is State.SUCCEEDED
    assert await fq.jobs.compensation_of(ok.job_id) is None
    # a failure that is retried is not a failure for good: no compensation (yet)
    assert (await fq.status(retried.job_id)).state is State.SCHEDULED
    assert await fq.jobs.compensation_of(retried.job_id) is None
    failed = await fq.status(bad.job_id)
    assert failed.state is State.FAILED
    comp_id = await fq.jobs.compensation_of(bad.job_id)
    assert comp_id is not None and fq.keys.shard_of(comp_id) == fq.keys.shard_of(bad.job_id)
    status, out = await fq.result(comp_id)
    assert status.type == "refund" and status.state is State.SUCCEEDED
    # the failed job's error as its status document has it, traceback included
    traceback = out["error"].pop("traceback")
    assert 'raise RuntimeError(f"card declined' in traceback
    assert failed.error is not None and traceback == failed.error.traceback
    assert out == {
        "job_id": bad.job_id,
        "type": "charge",
        "payload": {"card": "stolen", "fail": True},
        "error": {"type": "RuntimeError", "message": "card declined (attempt 1)"},
    }
    assert (await transitions(fq, comp_id))[0] == ("", "queued")


async def test_the_compensation_is_in_the_same_script_as_the_failure(fq: Queue) -> None:
    """No resolver, no worker: the fail.lua call that dead-letters the job, and the
    reclaim.lua call that gives up on an expired lease, create it themselves."""
    sub = await fq.submit("charge", {"fail": True}, max_attempts=1)
    # submitted now: older than sub's compensation (in sub's shard), so claimed before it
    lost = await fq.submit("charge", {"fail": True}, max_attempts=1)
    claimed = await claim(fq, sub.job_id)
    shard = fq.keys.shard_of(sub.job_id)
    reply = await fq.scripts.call(
        *fail_call(
            shard,
            "worker-a",
            60,
            [(sub.job_id, claimed.lease_version, b'{"type":"E","message":"no"}', -1)],
        )
    )
    assert parse_pairs(reply)[0][1] == b"failed"
    comp = await fq.jobs.compensation_of(sub.job_id)
    assert comp is not None and (await fq.status(comp)).state is State.QUEUED
    # a lease that expires on the last attempt
    await claim(fq, lost.job_id, lease_ms=1)
    lshard = fq.keys.shard_of(lost.job_id)
    s = fq.settings

    async def reclaimed() -> bool:
        await fq.scripts.call(
            *reclaim_call(lshard, 100, s.retention_seconds, s.dead_retention_seconds)
        )
        return (await fq.status(lost.job_id)).state is State.FAILED

    await wait_for(reclaimed)
    comp2 = await fq.jobs.compensation_of(lost.job_id)
    assert comp2 is not None
    payload = await fq.jobs.payload(comp2)
    assert payload["error"]["type"] == "LeaseExpired"


@pytest.mark.parametrize(
    "keyed",
    [
        {"throttle": {"key": "t", "limit": 5, "period": 60}},
        {"unique": {"key": "u"}},
        {"debounce": {"key": "d", "seconds": 0.001}},
    ],
    ids=["throttle", "unique", "debounce"],
)
async def test_a_keyed_job_that_fails_for_good_is_compensated(
    fq: Queue, keyed: dict[str, Any]
) -> None:
    """A job submitted under a throttle, unique or debounce key is created by keyed.lua, not
    submit.lua: its compensation is made all the same when it fails for good."""
    bad = await fq.submit("charge", {"card": "stolen", "fail": True}, max_attempts=1, **keyed)
    if "debounce" in keyed:  # due a millisecond on: made ready as the scheduler would
        shard = fq.keys.shard_of(bad.job_id)
        await fq.redis.zadd(fq.keys.sched(shard), {bad.job_id: 0})
        await fq.scripts.call(*promote_call(shard, 100))
    await run_flows(fq)
    assert (await fq.status(bad.job_id)).state is State.FAILED
    comp_id = await fq.jobs.compensation_of(bad.job_id)
    assert comp_id is not None
    status, out = await fq.result(comp_id)
    assert status.type == "refund" and out["job_id"] == bad.job_id
