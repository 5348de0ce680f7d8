"""A plain job's own callback given to the in-process ``Queue.submit`` / ``submit_many``: written
to Postgres as the API writes one, and delivered by a real dispatcher to a real receiver on
loopback (real Redis, real Postgres); refused callbacks and a Queue without a database write
and submit nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from standardwebhooks.webhooks import Webhook as Verifier

from jobtier.config import Settings
from jobtier.core.errors import ConfigError, InvalidRequest
from jobtier.core.model import CallbackSpec, FlowJob, JobSpec, Submitted
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.webhooks.callbacks import CallbackStore, SecretMissing
from jobtier.webhooks.dispatcher import Dispatcher
from tests.fixtures.api import ApiServer
from tests.fixtures.engine import wait_for
from tests.fixtures.receiver import (
    StartProducer,
    StartReceiver,
    delivered,
    deliveries,
    run_jobs,
    secret_of,
)
from tests.tasks import registry

REFUSED = "http://10.1.2.3/hook"  # a private address: the address policy refuses it


async def callback_rows(pool: Pool) -> list[tuple[str, str, str, str]]:
    rows = await pool.fetch(
        "SELECT job_id, tenant, url, events FROM webhook_job_callbacks ORDER BY job_id"
    )
    return [(r["job_id"], r["tenant"], r["url"], r["events"]) for r in rows]


async def jobs_in_redis(queue: Queue) -> int:
    """Jobs not started yet, every tenant, every shard."""
    return sum((await queue.admin.waiting_by_tenant()).values())


async def test_queue_submit_writes_the_callback_and_the_dispatcher_delivers_it(
    callback_producer: StartProducer, hook_api: ApiServer, hook_settings: Settings, queue: Queue, pool: Pool,
    start_receiver: StartReceiver, start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    producer = await callback_producer(hook_settings)
    try:
        # as over HTTP: no signing secret, no callback (and no job)
        with pytest.raises(SecretMissing):
            await producer.submit("echo", 1, tenant="acme", callback=receiver.url)
        assert await callback_rows(pool) == [] and await jobs_in_redis(queue) == 0
        async with hook_api.client("acme") as c:
            secret = await secret_of(c)
            one = await producer.submit("echo", {"n": 1}, tenant="acme", callback=receiver.url)
            assert one.created
            # a batch: one job with every transition, one with none; a refused URL names its
            # member and writes and submits nothing
            with pytest.raises(InvalidRequest) as refused:
                await producer.submit_many(
                    [JobSpec(type="echo", callback=CallbackSpec(url=receiver.url)),
                     JobSpec(type="echo", callback=CallbackSpec(url=REFUSED))],
                    tenant="acme",
                )  # fmt: skip
            assert refused.value.field == "jobs[1].callback.url"
            with pytest.raises(InvalidRequest) as alone:
                await producer.submit("echo", tenant="acme", callback=REFUSED)
            assert alone.value.field == "callback.url"
            assert await jobs_in_redis(queue) == 1
            every, plain = await producer.submit_many(
                [JobSpec(type="echo", payload=2,
                         callback=CallbackSpec(url=receiver.url + "?all", events="all")),
                 JobSpec(type="echo", payload=3)],
                tenant="acme",
            )  # fmt: skip
            assert isinstance(every, Submitted) and isinstance(plain, Submitted)
            # an idempotent repeat answers with the first job, which keeps its own callback;
            # the repeat's (under the id it would have had) is deleted again
            keyed = await producer.submit(
                "echo", 4, tenant="acme", idempotency_key="k1", callback=receiver.url + "?k"
            )
            again = await producer.submit(
                "echo", 4, tenant="acme", idempotency_key="k1", callback=receiver.url + "?k2"
            )
            assert not again.created and again.job_id == keyed.job_id
            assert await callback_rows(pool) == sorted([
                (one.job_id, "acme", receiver.url, "terminal"),
                (every.job_id, "acme", receiver.url + "?all", "all"),
                (keyed.job_id, "acme", receiver.url + "?k", "terminal"),
            ])  # fmt: skip
            await run_jobs(queue)
            start_dispatcher()
            await wait_for(lambda: delivered(c, one.job_id))
            await wait_for(lambda: delivered(c, keyed.job_id))
            await wait_for(lambda: delivered(c, every.job_id, 3))  # queued, running, succeeded
            assert await deliveries(c, plain.job_id) == []
    finally:
        await producer.close()
    assert len(receiver.requests) == 5
    by_job: dict[str, list[str]] = {}
    for got in receiver.requests:
        body = Verifier(secret).verify(got.body, got.headers)  # the reference verifier
        by_job.setdefault(body["data"]["id"], []).append(body["type"])
    assert by_job[one.job_id] == ["job.succeeded"]
    assert by_job[keyed.job_id] == ["job.succeeded"]
    assert sorted(by_job[every.job_id]) == ["job.queued", "job.running", "job.succeeded"]


async def test_without_a_callback_store_a_callback_is_refused_and_nothing_is_submitted(
    settings: Settings, queue: Queue
) -> None:
    """A Queue given no callback store opens none behind its caller's back: a job with a
    callback is refused whole, and a CallbackStore without a database says so."""
    with pytest.raises(ConfigError, match="JOBTIER_DATABASE_URL"):
        await CallbackStore.connect(settings.replace(database_url=""), queue.redis, queue.keys)
    bare = await Queue.connect(settings, registry)
    try:
        hook = CallbackSpec(url="https://hooks.example.com/jobs")
        with pytest.raises(ConfigError, match="no callback store"):
            await bare.submit("echo", 1, callback=hook)
        with pytest.raises(ConfigError, match="no callback store"):
            await bare.submit_many([JobSpec(type="echo"), JobSpec(type="echo", callback=hook)])
        with pytest.raises(ConfigError, match="no callback store"):
            await bare.submit_flow([FlowJob(type="echo", callback=hook)])
        assert await jobs_in_redis(queue) == 0
        assert (await queue.admin.stats())["total"]["queued"] == 0
        # without a callback, the same Queue submits as ever
        assert (await bare.submit("echo", 1)).created
        assert await jobs_in_redis(queue) == 1
    finally:
        await bare.close()
