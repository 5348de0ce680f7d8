"""Durable submit (``store/durable.py``, ``api/durable_submit.py``): a submit answers only once its
writes reached the replicas asked for, with WAIT on the connection that carried them.

Replicas are made to lag on purpose: SIGSTOP (the replica stays connected and stops
acknowledging: a WAIT of any other connection would still count it), or its link to the
master cut (``masterauth`` set to a password the master does not have: the replica stays
a replica of that master, holding what it had, and cannot resync). Then the master is
SIGKILLed and the stale replica promoted: what it lacks is what a failover loses.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import asyncpg
import httpx
import pytest
import redis as syncredis
from redis.asyncio.cluster import ClusterNode, PipelineCommand
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier import outbox
from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import ClaimedJob
from jobtier.dev.local_redis import LocalRedis
from jobtier.dev.local_replicas import LocalCluster, LocalSentinels
from jobtier.engine.produce import Producer
from jobtier.engine.queue import Queue
from jobtier.flows import batches
from jobtier.persist.db import Pool
from jobtier.persist.outbox import OutboxRelay
from jobtier.store import durable
from jobtier.store.calls import complete_call, promote_call, reclaim_call
from jobtier.store.durable import Unreplicated
from jobtier.store.redis import connect
from jobtier.store.scripts import Scripts
from tests.fixtures.api import StartApi
from tests.fixtures.engine import wait_for
from tests.tasks import registry

REPLICAS = "Jobtier-Replicas"


def sync(node: LocalRedis) -> syncredis.Redis:
    return syncredis.Redis(port=node.port, password=node.password, socket_timeout=10)


@contextmanager
def stopped(node: LocalRedis) -> Iterator[None]:
    """The replica frozen (SIGSTOP): connected, acknowledging nothing, until the block ends."""
    assert node.proc is not None
    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)


def cut(replica: LocalRedis) -> None:
    """Cut the replica off its master for good: it keeps what it has and gets nothing more."""
    with sync(replica) as r:
        r.config_set("masterauth", "not-the-masters-password")
        r.execute_command("CLIENT", "KILL", "TYPE", "master")
        offset = r.info("replication")["slave_repl_offset"]
    with sync(replica) as r:  # the link is down once the master is gone from its clients
        for _ in range(200):
            if r.info("replication")["master_link_status"] == "down":
                break
    assert offset >= 0


def mend(replica: LocalRedis) -> None:
    with sync(replica) as r:
        r.config_set("masterauth", "")


Cut = Callable[[LocalRedis], None]


@pytest.fixture
def cutter() -> Iterator[Cut]:
    """``cut``, the replicas it cut mended after the test whatever its end (before the
    server fixtures, set up first, check that every replica is attached again)."""
    done: list[LocalRedis] = []

    def cut_off(replica: LocalRedis) -> None:
        done.append(replica)
        cut(replica)

    yield cut_off
    for replica in done:
        if replica.pid is not None:
            with suppress(syncredis.RedisError):
                mend(replica)


# --- every submit route, against a server without replicas ------------------------------------
async def test_every_submit_route_waits_for_its_replicas(start_api: StartApi) -> None:
    """JOBTIER_SUBMIT_REPLICAS=1 on a Redis with no replica: every submit route answers 503
    after the timeout, saying how many replicas confirmed and that the job may exist; a
    request's header 0 opts out, one asking for more replicas than there are is a 400."""
    api = await start_api(submit_replicas=1, submit_replicas_timeout_ms=50)
    flow = [{"type": "echo", "ref": "a"}, {"type": "echo", "after": ["a"]}]
    routes: list[tuple[str, dict[str, Any]]] = [
        ("/v1/jobs", {"type": "echo", "payload": 1, "idempotency_key": "j"}),
        ("/v1/jobs/batch", {"jobs": [{"type": "echo"}, {"type": "echo"}]}),
        ("/v1/flows", {"jobs": flow, "idempotency_key": "f"}),
        ("/v1/batches", {"type": "echo", "items": [1, 2, 3], "idempotency_key": "b"}),
    ]
    async with api.client() as c:
        for path, body in routes:
            r = await c.post(path, json=body)
            assert r.status_code == 503, (path, r.text)
            problem = r.json()
            assert problem["type"] == "urn:jobtier:problem:replicas-unconfirmed"
            assert (problem["replicas_confirmed"], problem["replicas_wanted"]) == (0, 1)
            assert "JOBTIER_SUBMIT_REPLICAS" in problem["detail"]
            assert "same idempotency key" in problem["detail"]
            assert r.headers["retry-after"] == "1"
            r = await c.post(path, json=body, headers={REPLICAS: "0"})
            assert r.status_code in (200, 202), (path, r.text)
            if "idempotency_key" in body:  # a repeat writes nothing, and still waits
                r = await c.post(path, json=body)
                assert r.status_code == 503, (path, r.text)
        r = await c.post("/v1/jobs", json={"type": "echo"}, headers={REPLICAS: "2"})
        assert r.status_code == 400 and r.json()["field"] == REPLICAS
        assert "more replicas than" in r.json()["detail"]
        r = await c.post("/v1/jobs", json={"type": "echo"}, headers={REPLICAS: "one"})
        assert r.status_code == 400 and r.json()["field"] == REPLICAS


def test_the_settings_are_checked() -> None:
    from jobtier.core.errors import ConfigError

    with pytest.raises(ConfigError, match="JOBTIER_SUBMIT_REPLICAS must"):
        Settings.from_env({"JOBTIER_SUBMIT_REPLICAS": "-1"})
    with pytest.raises(ConfigError, match="JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS"):
        Settings.from_env({"JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS": "0"})


# --- Sentinel: one master, one replica ----------------------------------------------------------
# (through the engine: the store layer's WAIT, without the API around it)
CONFIRM_MS = 3000  # a WAIT expected to be confirmed: ample, and below the socket timeout (5 s)
SHORT_MS = 300  # a WAIT expected to time out (the replica frozen or cut off)


@pytest.fixture
async def sq(sentinel_settings: Settings) -> Any:
    queue = await Queue.connect(sentinel_settings.replace(require_known_types=False), catalog=False)
    yield queue
    await queue.close()


async def retrying(call: Any, seconds: float = 30.0) -> Any:
    """``call()`` again until the client finds the promoted master (its old connections fail)."""
    async with asyncio.timeout(seconds):
        while True:
            try:
                return await call()
            except (syncredis.ConnectionError, syncredis.TimeoutError, syncredis.ReadOnlyError):
                await asyncio.sleep(0.05)


async def submit(
    queue: Queue, key: str, replicas: int, wait_ms: int = CONFIRM_MS
) -> tuple[str, durable.Durable]:
    """A submit as the API makes it with ``Jobtier-Replicas: replicas``, its WAIT ``wait_ms``
    at most."""
    with durable.waiting(replicas, wait_ms) as state:
        job = await queue.produce.submit("echo", key, idempotency_key=key)
    return job.job_id, state


def pair(sentinels: LocalSentinels) -> tuple[LocalRedis, LocalRedis]:
    master = sentinels.master()
    (replica,) = [n for n in sentinels.nodes if n is not master and n.pid is not None]
    return master, replica


async def fail_over(sentinels: LocalSentinels, master: LocalRedis, replica: LocalRedis) -> None:
    """SIGKILL the master; the sentinels promote the replica, stale as it is."""
    sentinels.kill(master)
    mend(replica)
    assert await asyncio.to_thread(sentinels.wait_promoted, master) is replica


def kept(node: LocalRedis, keys: Keys, ids: list[str]) -> list[str]:
    with sync(node) as r:
        return [i for i in ids if r.exists(keys.job(i))]


async def test_wait_counts_the_submits_own_write(sq: Queue, sentinels: LocalSentinels) -> None:
    """With the replica frozen, the submit's own WAIT counts no replica and the submit is
    refused, where a WAIT on another connection, opened before the submit, counts the frozen
    replica at once (its acknowledgements cover that connection's older writes). Once the replica catches up, the same
    idempotency key gets the job that the first attempt made."""
    master, replica = pair(sentinels)
    _, state = await submit(sq, "first", 1)
    assert (state.confirmed, state.short) == (1, False)
    with sync(master) as idle:
        # a connection of its own, open before the submit, the replica caught up with it
        assert idle.execute_command("WAIT", 1, 5000) == 1
        with stopped(replica):
            job_id, state = await submit(sq, "own-write", 1, SHORT_MS)
            assert (state.confirmed, state.short) == (0, True)
            assert idle.execute_command("WAIT", 1, 100) == 1  # another connection: yes
    await asyncio.to_thread(sentinels.wait_replicated)
    again, state = await submit(sq, "own-write", 1)
    assert again == job_id and not state.short


async def test_an_in_process_queue_honours_the_setting(
    sentinel_settings: Settings, sentinels: LocalSentinels
) -> None:
    """``Queue.submit`` (and its other submits) with JOBTIER_SUBMIT_REPLICAS: acknowledged
    only once the replica confirmed; with the replica frozen, ``Unreplicated``, and the same
    key once it caught up returns the job the refused call made."""
    settings = sentinel_settings.replace(
        require_known_types=False, submit_replicas=1, submit_replicas_timeout_ms=CONFIRM_MS
    )  # the frozen replica's calls wait it out: long enough for the others on a busy machine
    _, replica = pair(sentinels)
    async with await Queue.connect(settings, catalog=False) as queue:
        first = await queue.submit("echo", "a", idempotency_key="in-process-a")
        assert first.created
        with stopped(replica):
            with pytest.raises(Unreplicated, match="0 of 1 replicas"):
                await queue.submit("echo", "b", idempotency_key="in-process-b")
            with pytest.raises(Unreplicated):  # a repeat writes nothing, and is not confirmed
                await queue.submit("echo", "b", idempotency_key="in-process-b")
        await asyncio.to_thread(sentinels.wait_replicated)
        again = await queue.submit("echo", "b", idempotency_key="in-process-b")
        assert not again.created
        assert kept(replica, queue.keys, [first.job_id, again.job_id]) == [
            first.job_id,
            again.job_id,
        ]


async def test_a_durable_submit_is_never_acknowledged_and_lost(
    sq: Queue, sentinels: LocalSentinels, cutter: Cut
) -> None:
    """(a) Durable submits acknowledged before the replica fell behind survive the master's
    loss; those made after it are refused (the replicas did not confirm them), none is
    acknowledged and lost, and a retry with the same key on the promoted master makes them."""
    master, replica = pair(sentinels)
    acknowledged = []
    for i in range(20):
        job_id, state = await submit(sq, f"before-{i}", 1)
        assert (state.confirmed, state.short) == (1, False)
        acknowledged.append(job_id)
    cutter(replica)
    for i in range(5):
        job_id, state = await submit(sq, f"after-{i}", 1, SHORT_MS)
        assert state.short and state.confirmed == 0  # the API answers 503: not acknowledged
    await fail_over(sentinels, master, replica)
    assert kept(replica, sq.keys, acknowledged) == acknowledged
    # the promoted master has no replica yet: still refused, never acknowledged
    _, state = await retrying(lambda: submit(sq, "after-0", 1, SHORT_MS))
    assert state.short
    await asyncio.to_thread(sentinels.revive, master)  # back, as the promoted one's replica
    for i in range(5):  # the client retries its refused submits with their keys
        job_id, state = await submit(sq, f"after-{i}", 1)
        assert not state.short and kept(replica, sq.keys, [job_id]) == [job_id]


async def test_without_durable_submit_an_acknowledged_job_can_be_lost(
    sq: Queue, sentinels: LocalSentinels, cutter: Cut
) -> None:
    """(b) The window durable submit closes: submits acknowledged while the replica lagged
    are gone once the master dies and that replica is promoted."""
    master, replica = pair(sentinels)
    before, _ = await submit(sq, "before", 1)
    cutter(replica)
    lagged = [(await submit(sq, f"lagged-{i}", 0))[0] for i in range(10)]
    assert kept(master, sq.keys, lagged) == lagged  # acknowledged, on the master
    await fail_over(sentinels, master, replica)
    assert kept(replica, sq.keys, [before]) == [before]
    assert kept(replica, sq.keys, lagged) == []  # every one of them lost


def caught_up(master: LocalRedis, replica: LocalRedis) -> bool:
    with sync(master) as m, sync(replica) as r:
        offset = m.info("replication")["master_repl_offset"]
        return bool(r.info("replication")["slave_repl_offset"] >= offset)


@pytest.mark.parametrize("lost", ["claim", "completion"])
async def test_a_lost_transition_runs_the_job_again(
    sq: Queue, sentinels: LocalSentinels, lost: str, cutter: Cut
) -> None:
    """(c) Transitions stay asynchronous: a claim, or a completion, made on the master while
    the replica lagged is lost with the master. The job is not: it is queued again (its claim
    lost), or its lease runs out and it is reclaimed (its completion lost), and it runs a
    second time to a final state: at least once."""
    master, replica = pair(sentinels)
    job_id, state = await submit(sq, "once", 1)
    assert not state.short
    shard, s = sq.keys.shard_of(job_id), sq.settings
    lease_ms = 1000
    if lost == "claim":
        cutter(replica)
    (job,) = (await sq.scripts.claim(shard, "w1", 1, lease_ms)).jobs  # run 1
    if lost == "completion":
        await wait_for(lambda: caught_up(master, replica))
        cutter(replica)
    done = complete_call(shard, "w1", s.retention_seconds, [(job.id, job.lease_version, b"1")])
    await sq.scripts.call(*done)
    assert (await sq.status(job_id)).state == "succeeded"  # on the master, not on the replica

    await fail_over(sentinels, master, replica)
    status = await retrying(lambda: sq.status(job_id))
    assert status.state == ("queued" if lost == "claim" else "running")

    async def claimed_again() -> list[ClaimedJob]:
        # what the scheduler does (scheduler.py): expired leases back to their queue, due
        # retries promoted; then what a worker does: claim
        await sq.scripts.call(*reclaim_call(shard, 10, s.retention_seconds, 60))
        await sq.scripts.call(*promote_call(shard, 10))
        return (await sq.scripts.claim(shard, "w2", 1, lease_ms)).jobs

    again: list[ClaimedJob] = []

    async def runs_again() -> bool:
        again.extend(await claimed_again())
        return bool(again)

    await wait_for(runs_again, timeout=30)  # run 2
    (job,) = again
    done = complete_call(shard, "w2", s.retention_seconds, [(job.id, job.lease_version, b"2")])
    await sq.scripts.call(*done)
    final = await sq.status(job_id)
    assert final.state == "succeeded"
    assert final.attempt == (1 if lost == "claim" else 2)


# --- Redis Cluster: three masters, a replica each, through the API ------------------------------
def cluster_overrides(cluster: LocalCluster) -> dict[str, Any]:
    return {"redis_url": cluster.url, "redis_cluster": True, "shards": 16}


def keys_on(
    cluster: LocalCluster, keys: Keys, master: LocalRedis, prefix: str, n: int
) -> list[str]:
    """``n`` idempotency keys whose jobs (tenant acme) live on ``master``'s slots."""
    found = []
    for i in range(10_000):
        key = f"{prefix}-{i}"
        slot = key_slot(keys.base(keys.shard_for("acme", key)).encode())
        if cluster.master_of_slot(slot) is master:
            found.append(key)
            if len(found) == n:
                return found
    raise AssertionError("no such keys")


async def post(c: httpx.AsyncClient, key: str, replicas: int) -> httpx.Response:
    body = {"type": "echo", "payload": key, "idempotency_key": key}
    return await c.post("/v1/jobs", json=body, headers={REPLICAS: str(replicas)})


async def test_the_wait_goes_to_the_node_of_the_submits_slot(
    start_api: StartApi, failover_cluster: LocalCluster
) -> None:
    """With one master's replica frozen, durable submits to that master's slots answer 503
    and those to the other masters' 202: each node's WAIT follows its own calls, on their
    connection. A batch touching every master is refused as a whole."""
    api = await start_api(**cluster_overrides(failover_cluster), submit_replicas_timeout_ms=300)
    keys = Keys(api.settings.prefix, api.settings.shards)
    lagging, healthy, *_ = failover_cluster.masters()
    (replica,) = failover_cluster.replicas_of(lagging)
    (slow,) = keys_on(failover_cluster, keys, lagging, "slow", 1)
    (fine,) = keys_on(failover_cluster, keys, healthy, "fine", 1)
    async with api.client() as c:
        with stopped(replica):
            r = await post(c, slow, 1)
            assert r.status_code == 503 and r.json()["replicas_confirmed"] == 0, r.text
            r = await post(c, fine, 1)
            assert r.status_code == 202, r.text
            batch = {"jobs": [{"type": "echo", "payload": i} for i in range(32)]}
            r = await c.post("/v1/jobs/batch", json=batch, headers={REPLICAS: "1"})
            assert r.status_code == 503, r.text
        await asyncio.to_thread(failover_cluster.wait_replicated)
        r = await post(c, slow, 1)
        assert r.status_code == 200, r.text  # the job the refused attempt made


async def test_a_repeated_flow_waits_on_every_node_holding_its_jobs(
    start_api: StartApi, failover_cluster: LocalCluster
) -> None:
    """A keyed flow repeated after it finished is answered from what the first submit made,
    whose writes may still be on their masters alone: the repeat WAITs on every node holding
    the flow's jobs, not only on its head's. With the replica of a master holding some of its
    jobs (not the head) frozen, the repeat answers 503."""
    # 2 s: long enough for the first submit's WAIT on a loaded machine, one 503 waits it out
    api = await start_api(**cluster_overrides(failover_cluster), submit_replicas_timeout_ms=2000)
    keys = Keys(api.settings.prefix, api.settings.shards)
    body = {"jobs": [{"type": "echo", "payload": i} for i in range(12)], "idempotency_key": "fl"}
    headers = {REPLICAS: "1"}
    async with api.client() as c:
        r = await c.post("/v1/flows", json=body, headers=headers)
        assert r.status_code == 202, r.text
        ids = [j["id"] for j in r.json()["jobs"]]
        masters = [
            failover_cluster.master_of_slot(key_slot(keys.base(keys.shard_of(i)).encode()))
            for i in ids
        ]
        head = masters[0]  # a flow of independent jobs: its first is its head
        others = [m for m in masters if m is not head]
        assert others, "every job of the flow on the head's master"
        (replica,) = failover_cluster.replicas_of(others[0])
        with stopped(replica):
            r = await c.post("/v1/flows", json=body, headers=headers)
            assert r.status_code == 503, r.text
        await asyncio.to_thread(failover_cluster.wait_replicated)
        r = await c.post("/v1/flows", json=body, headers=headers)
        assert r.status_code == 200 and [j["id"] for j in r.json()["jobs"]] == ids, r.text


async def test_a_batchs_idempotency_key_is_confirmed_on_its_own_node(
    failover_cluster: LocalCluster,
) -> None:
    """A batch's idempotency key is a plain SET on the node of its own shard, which may hold
    none of the batch's writes (whose WAITs then do not cover it): the key gets its own WAIT.
    With that node's replica frozen, the durable submit counts 0 replicas: a 503."""
    settings = Settings.from_env({}, **cluster_overrides(failover_cluster))
    async with await Queue.connect(settings, catalog=False) as queue:
        store = queue.store
        master = failover_cluster.masters()[0]
        (key,) = keys_on(failover_cluster, queue.keys, master, "batch-key", 1)
        batch = batches.PreparedBatch(
            batch_id="b1", tenant="acme", type="echo", queue="default", priority="normal",
            max_attempts=1, children=[], idempotency_key=key, digest="d",
        )  # fmt: skip
        (replica,) = failover_cluster.replicas_of(master)
        with stopped(replica), durable.waiting(1, SHORT_MS) as state:
            assert await batches._first_with_key(store, batch) is None  # the key is ours
        assert (state.waits, state.short) == (1, True)


async def test_cluster_failover_keeps_what_durable_submit_acknowledged(
    start_api: StartApi, failover_cluster: LocalCluster, cutter: Cut
) -> None:
    """(a) and (b) on a cluster: one master's replica cut off, that master SIGKILLed and the
    stale replica promoted. Durable submits acknowledged before are kept, those after were
    refused; plain submits acknowledged after are lost."""
    api = await start_api(**cluster_overrides(failover_cluster), submit_replicas_timeout_ms=300)
    keys = Keys(api.settings.prefix, api.settings.shards)
    victim = failover_cluster.masters()[0]
    (replica,) = failover_cluster.replicas_of(victim)
    before, refused, plain = (keys_on(failover_cluster, keys, victim, p, 8) for p in "bdp")
    acknowledged, lagged = [], []
    async with api.client() as c:
        for key in before:
            r = await post(c, key, 1)
            assert r.status_code == 202, r.text
            acknowledged.append(r.json()["id"])
        cutter(replica)
        for key in refused:
            assert (await post(c, key, 1)).status_code == 503
        for key in plain:
            r = await post(c, key, 0)
            assert r.status_code == 202, r.text
            lagged.append(r.json()["id"])
    failover_cluster.kill(victim)
    mend(replica)
    assert await asyncio.to_thread(failover_cluster.wait_promoted, victim) is replica
    assert kept(replica, keys, acknowledged) == acknowledged
    assert kept(replica, keys, lagged) == []


async def test_a_nodes_failed_send_is_raised_once_the_other_nodes_answered(
    failover_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A durable write's pipelines go to every node at once; one node's failure is raised
    only once the others' pipelines ended, none left running unawaited behind the error."""
    settings = Settings.from_env({}, **cluster_overrides(failover_cluster))
    real = ClusterNode.execute_pipeline
    failing: list[str] = []
    answered: list[str] = []
    release = asyncio.Event()

    async def one_node_down(node: ClusterNode, commands: list[PipelineCommand]) -> bool:
        if not failing or node.name == failing[0]:
            failing.append(node.name)
            raise RedisConnectionError("Connection closed by server.")
        await release.wait()  # the healthy nodes answer after the failure was raised
        result = await real(node, commands)
        answered.append(node.name)
        return result

    async def release_later() -> None:
        for _ in range(20):  # turns of the event loop, not time
            await asyncio.sleep(0)
        release.set()

    redis = connect(settings)
    releaser = asyncio.create_task(release_later())
    try:
        scripts = Scripts(redis, Keys(settings.prefix, settings.shards))
        monkeypatch.setattr(ClusterNode, "execute_pipeline", one_node_down)
        with durable.waiting(1, 10), pytest.raises(RedisConnectionError):
            await scripts.confirm(range(settings.shards))
        assert len(set(answered)) == len(failover_cluster.masters()) - 1
    finally:
        monkeypatch.undo()
        release.set()
        await releaser
        # the failed send asks the client to learn the topology again, and a client in that
        # state closes nothing: learnt again, its connections are all closed
        await redis.initialize()
        await redis.aclose()


# --- the outbox relay -----------------------------------------------------------------------------
async def test_the_outbox_relay_marks_rows_relayed_only_once_replicated(
    pg_settings: Settings, pg_pool: Pool, pg_dsn: str, queue: Queue
) -> None:
    """With JOBTIER_SUBMIT_REPLICAS=1 and no replica to confirm, the relay's pass fails and
    the row stays in the outbox, not relayed; relayed again once it can be (same id)."""
    durable_settings = pg_settings.replace(submit_replicas=1, submit_replicas_timeout_ms=50)
    relay = OutboxRelay(durable_settings, pg_pool, Producer(queue.store, registry, True, None))
    assert await relay.drain() == 0  # the first pass records the shard count
    app = await asyncpg.connect(pg_dsn)
    try:
        job_id = await outbox.submit(app, "echo", {"n": 1})
    finally:
        await app.close()
    with pytest.raises(Unreplicated, match="0 of 1 replicas"):
        await relay.relay_once()
    (row,) = await pg_pool.fetch("SELECT id, relayed_at FROM jobtier.outbox")
    assert (row["id"], row["relayed_at"]) == (job_id, None)
    plain = OutboxRelay(pg_settings, pg_pool, Producer(queue.store, registry, True, None))
    assert await plain.drain() == 1
    (row,) = await pg_pool.fetch("SELECT id, relayed_at FROM jobtier.outbox")
    assert row["relayed_at"] is not None
    assert (await queue.status(job_id)).state == "queued"
