"""Testing example_tasks: unit tests with run_task (no servers), then an integration test
with the pytest plugin's fixtures (a throw-away redis-server, a Queue, a burst worker).

    pip install jobtier pytest pytest-asyncio   # and redis-server for the integration test
    pytest examples/
"""

from __future__ import annotations

import hashlib
from types import ModuleType

import example_tasks
import pytest
from example_tasks import checksum, thumbnail

from jobtier import Queue
from jobtier.testing import BurstWorker, run_task, run_task_sync


# --- unit tests: one attempt, in this process ---------------------------------------------------
async def test_thumbnail_succeeds_and_reports_progress() -> None:
    outcome = await run_task(thumbnail, {"image": "a.png", "sizes": [64, 128]})
    assert outcome.state == "succeeded"
    assert outcome.result == {
        "urls": [f"https://cdn.example/{outcome.job_id}/{size}.png" for size in (64, 128)]
    }
    assert outcome.progress == [{"done": 1, "of": 2}, {"done": 2, "of": 2}]


async def test_storage_outage_is_retried_with_backoff_then_dead_lettered() -> None:
    payload = {"image": "a.png", "storage_down": True}
    second = await run_task(thumbnail, payload, attempt=2)
    assert second.state == "retry" and second.retry_in == 2.0  # 1 s * 2 ** (2 - 1)
    assert second.error is not None and second.error.type == "ConnectionError"
    last = await run_task(thumbnail, payload, attempt=4)  # retries=3: the 4th is the last
    assert last.state == "failed"


async def test_a_bad_image_goes_straight_to_the_dead_letters() -> None:
    outcome = await run_task(thumbnail, {"image": "a.gif"})
    assert outcome.state == "failed"
    assert outcome.error is not None and outcome.error.message == "a.gif is not a PNG"


def test_checksum_stops_when_cancelled() -> None:  # a plain test: the sync variant
    outcome = run_task_sync(checksum, {"chunks": ["a"] * 10_000}, cancel_after_progress=1)
    assert outcome.state == "cancelled"
    assert outcome.progress[0] == 1


# --- integration test: real Redis, real worker ---------------------------------------------------
@pytest.fixture
def jobtier_tasks() -> ModuleType:
    """The tasks the queue knows and the worker runs."""
    return example_tasks


async def test_jobs_run_end_to_end(jobtier_queue: Queue, jobtier_worker: BurstWorker) -> None:
    image = await jobtier_queue.submit("thumbnail", {"image": "a.png", "sizes": [32]})
    gif = await jobtier_queue.submit("thumbnail", {"image": "a.gif"})
    summed = await jobtier_queue.submit(checksum, {"chunks": ["ab", "c"]})

    stats = await jobtier_worker()  # until no job is ready or running

    assert (stats.succeeded, stats.failed) == (2, 1)
    status, result = await jobtier_queue.result(image.job_id)
    assert status.state == "succeeded" and result["urls"][0].endswith("/32.png")
    assert status.progress == {"done": 1, "of": 1}
    assert (await jobtier_queue.status(gif.job_id)).state == "failed"
    assert [job.id for job in await jobtier_queue.jobs.dead_letters()] == [gif.job_id]
    _, digest = await jobtier_queue.result(summed.job_id)
    assert digest == hashlib.sha256(b"abc").hexdigest()
