"""A ``Queue`` given no registry finds a task by its name in the workers' catalogue, as the
API does: its queue, attempts and payload check; a type no worker advertises is refused
(``JOBTIER_REQUIRE_KNOWN_TYPES``), and a worker that advertises later is found."""

from __future__ import annotations

import dataclasses

import pytest

from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest, UnknownTask
from jobtier.core.model import JobSpec
from jobtier.engine.catalog import publish
from jobtier.engine.queue import Queue
from jobtier.flows.batches import child_ids
from tests.fixtures.engine import wait_for
from tests.tasks import registry

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster

# tests/tasks.py: @task(queue="images", retries=4), its payload a Struct (url, width)
_thumbnail = registry.get("thumbnail")
assert _thumbnail is not None
THUMBNAIL = _thumbnail


async def advertise(queue: Queue) -> None:
    """What a worker with the task writes at its start and each full heartbeat."""
    await publish(queue.redis, queue.keys, [THUMBNAIL.ad("worker-1")])


async def test_a_job_submitted_by_name_gets_its_tasks_queue_attempts_and_check(
    settings: Settings,
) -> None:
    async with await Queue.connect(settings) as queue:
        await advertise(queue)
        await queue.produce.tasks.load()  # type: ignore[union-attr]  # (the next refresh)
        job = await queue.submit("thumbnail", {"url": "a.png"})
        status = await queue.status(job.job_id)
        assert (status.queue, status.max_attempts) == ("images", THUMBNAIL.max_attempts)
        assert THUMBNAIL.max_attempts == 5  # not JOBTIER_DEFAULT_MAX_ATTEMPTS's 3
        # a batch and submit_many look it up too; what a submit names wins
        (many,) = await queue.submit_many([JobSpec(type="thumbnail", payload={"url": "b"})])
        assert not isinstance(many, Exception)
        assert (await queue.status(many.job_id)).queue == "images"
        named = await queue.submit("thumbnail", {"url": "c"}, queue="urgent", max_attempts=1)
        status = await queue.status(named.job_id)
        assert (status.queue, status.max_attempts) == ("urgent", 1)
        batch = await queue.submit_batch("thumbnail", [{"url": "d"}, {"url": "e"}])
        assert batch.total == 2
        for child in child_ids(queue.keys, batch.id, batch.total):
            status = await queue.status(child)
            assert (status.queue, status.max_attempts) == ("images", 5), status

        # a typo, and a payload the task's type refuses: refused, nothing written
        before = await queue.admin.stats()
        with pytest.raises(UnknownTask, match=r"no worker runs task 'thumbnial' .*thumbnail"):
            await queue.submit("thumbnial", {"url": "a.png"})
        with pytest.raises(InvalidRequest) as refused:
            await queue.submit("thumbnail", {"url": "a.png", "width": "wide"})
        assert refused.value.field == "payload.width"
        assert (await queue.admin.stats())["total"] == before["total"]
        catalog = queue._catalog
        assert catalog is not None and catalog._task is not None
        refreshing = catalog._task
    # closing the queue stops its catalogue's refresh
    assert refreshing.done() and queue._catalog is None


async def test_a_worker_that_advertises_after_the_connect_is_found(settings: Settings) -> None:
    async with await Queue.connect(settings) as queue:
        with pytest.raises(UnknownTask, match="known: none"):
            await queue.submit("thumbnail", {"url": "a.png"})
        await advertise(queue)
        made = []

        async def accepted() -> bool:
            try:
                made.append(await queue.submit("thumbnail", {"url": "a.png"}))
            except UnknownTask:
                return False  # looked up again at most once a second (MISS_REFRESH)
            return True

        await wait_for(accepted, timeout=30, interval=0.1)
        assert (await queue.status(made[0].job_id)).queue == "images"


async def test_without_the_catalogue_or_refusals(settings: Settings) -> None:
    # JOBTIER_REQUIRE_KNOWN_TYPES=0: an unknown type is taken, a known one still looked up
    lenient = dataclasses.replace(settings, require_known_types=False)
    async with await Queue.connect(lenient) as queue:
        await advertise(queue)
        await queue.produce.tasks.load()  # type: ignore[union-attr]
        unknown = await queue.submit("not_advertised", 1)
        known = await queue.submit("thumbnail", {"url": "a.png"})
        assert (await queue.status(unknown.job_id)).queue == "default"
        assert (await queue.status(known.job_id)).queue == "images"
    # catalog=False: nothing looked up, every job as its submit names it
    async with await Queue.connect(settings, catalog=False) as queue:
        job = await queue.submit("thumbnail", {"width": "not checked"})
        status = await queue.status(job.job_id)
        assert (status.queue, status.max_attempts) == ("default", settings.default_max_attempts)
    # a registry given: it, not the catalogue, and refusals by default
    async with await Queue.connect(lenient, registry) as queue:
        with pytest.raises(UnknownTask):
            await queue.submit("not_in_the_registry", 1)
        assert queue._catalog is None
