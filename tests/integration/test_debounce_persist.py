"""A debounced job in Postgres: the payload that replaced the first one, and every version of
the job in its history (docs/debounce-throttle.md)."""

from __future__ import annotations

import pytest

from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister


@pytest.mark.parametrize("batch", [1, 64])  # each entry its own batch, or both in one
async def test_postgres_keeps_the_last_payload_and_every_version(
    pg_settings: Settings, pg_pool: Pool, batch: int
) -> None:
    async with await Queue.connect(pg_settings, catalog=False) as queue:
        option = {"key": "k", "seconds": 60}
        first = await queue.submit("echo", {"n": 1}, debounce=option)
        await queue.submit("echo", {"n": 2}, priority="high", debounce=option)
        persister = Persister(
            pg_settings.replace(persist_batch_size=batch), queue.redis, pg_pool, "p1"
        )
        assert await persister.drain() == 2
    row = await pg_pool.fetchrow(
        "SELECT payload::text, priority, state, version FROM jobs WHERE id = $1", first.job_id
    )
    assert row is not None
    assert tuple(row) == ('{"n":2}', "high", "scheduled", 2)
    versions = await pg_pool.fetch(
        "SELECT version FROM job_transitions WHERE job_id = $1 ORDER BY version", first.job_id
    )
    assert [r["version"] for r in versions] == [1, 2]
