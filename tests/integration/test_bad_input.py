"""Bad input to the Python API is a clear exception and changes nothing in Redis."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from jobtier.core.errors import InvalidRequest, JobNotFound, UnknownTask
from jobtier.core.model import JobSpec, Priority
from jobtier.engine.queue import Queue
from tests.tasks import registry

NOW = datetime.now(UTC)

BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("unknown task", {"type": "no_such_task"}, UnknownTask, "no worker runs task"),
    ("bad type name", {"type": "has space"}, InvalidRequest, "type"),
    ("payload not JSON", {"type": "echo", "payload": {"x": object()}}, InvalidRequest, "JSON"),
    ("payload too large", {"type": "echo", "payload": "x" * 300_000}, InvalidRequest, "limit"),
    ("bad priority", {"type": "echo", "priority": "urgent"}, InvalidRequest, "priority"),
    ("max_attempts 0", {"type": "echo", "max_attempts": 0}, InvalidRequest, "max_attempts"),
    ("max_attempts huge", {"type": "echo", "max_attempts": 10_000}, InvalidRequest, "max_attempts"),
    ("negative delay", {"type": "echo", "delay": -1}, InvalidRequest, "delay"),
    ("NaN delay", {"type": "echo", "delay": float("nan")}, InvalidRequest, "delay"),
    ("far delay", {"type": "echo", "delay": 10**9}, InvalidRequest, "delay"),
    ("run_at past", {"type": "echo", "run_at": NOW - timedelta(days=1)}, InvalidRequest, "past"),
    ("run_at far", {"type": "echo", "run_at": NOW + timedelta(days=4000)}, InvalidRequest, "ahead"),
    ("run_at naive", {"type": "echo", "run_at": datetime(2030, 1, 1)}, InvalidRequest, "time zone"),
    ("both times", {"type": "echo", "delay": 1, "run_at": NOW}, InvalidRequest, "not both"),
    ("bad key", {"type": "echo", "idempotency_key": "has space"}, InvalidRequest, "idempotency"),
    ("long key", {"type": "echo", "idempotency_key": "k" * 201}, InvalidRequest, "idempotency"),
]


async def stored(queue: Queue) -> list[bytes]:
    """What Redis holds besides the shards' job format marks (set at connect: store/format.py)."""
    return [k async for k in queue.redis.scan_iter() if not k.endswith((b":fmt", b":fmt:done"))]


@pytest.mark.parametrize(("case", "kwargs", "error", "words"), BAD, ids=[b[0] for b in BAD])
async def test_bad_submit_raises_and_changes_nothing(
    queue: Queue, case: str, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    queue.produce.tasks = registry
    kwargs = dict(kwargs)
    kind = kwargs.pop("type")
    payload = kwargs.pop("payload", None)
    with pytest.raises(error, match=words):
        await queue.submit(kind, payload, **kwargs)
    assert await stored(queue) == []


async def test_bad_tenant(queue: Queue) -> None:
    with pytest.raises(InvalidRequest, match="tenant"):
        await queue.submit("echo", None, tenant="bad tenant!")
    assert await stored(queue) == []


async def test_one_bad_job_in_a_batch_submits_none(queue: Queue) -> None:
    specs = [JobSpec(type="echo", payload=i) for i in range(5)]
    specs.insert(3, JobSpec(type="echo", priority=cast(Priority, "nope")))  # not a Priority
    with pytest.raises(InvalidRequest, match=r"jobs\[3\]"):
        await queue.submit_many(specs)
    with pytest.raises(InvalidRequest, match="at most"):
        await queue.submit_many([JobSpec(type="echo")] * (queue.settings.max_batch + 1))
    assert await stored(queue) == []


@pytest.mark.parametrize(
    "job_id", ["", "nope", "01M8KK4FZ54RBHFVYBN6HBV0CZ-99", "../etc", "x" * 500]
)
async def test_malformed_or_foreign_ids_are_not_found(queue: Queue, job_id: str) -> None:
    for call in (queue.status, queue.cancel, queue.jobs.replay):
        with pytest.raises(JobNotFound):
            await call(job_id)
    assert await stored(queue) == []
