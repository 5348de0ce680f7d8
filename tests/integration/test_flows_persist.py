"""Flows reach Postgres: the waiting state, each job's dependencies (job_dependencies), a
history that proves itself complete across the resolver's unlogged count updates, and the
dependencies read back from Postgres once Redis no longer holds the job."""

from __future__ import annotations

import pytest

from jobtier.config import Settings
from jobtier.core.model import FlowJob, State
from jobtier.engine.queue import Queue
from jobtier.flows import chain, fan_in
from jobtier.persist.db import Pool, query
from jobtier.persist.persister import Persister
from jobtier.persist.pg_reader import PgReader
from jobtier.streams.entries import parse_entries
from tests.fixtures.postgres import assert_pg_matches_redis, log_entries
from tests.flows_helpers import run_flows
from tests.tasks import registry

pytestmark = pytest.mark.contract


async def test_flows_reach_postgres(pg_settings: Settings, pg_pool: Pool) -> None:
    q = await Queue.connect(pg_settings, registry)
    try:
        existing = await q.submit("echo", "old")
        fan = await q.submit_flow(
            fan_in(
                FlowJob(type="collect", depends_on=[existing.job_id]),
                [FlowJob(type="echo", payload=i) for i in range(10)],
            )
        )
        steps = await q.submit_flow(
            chain(FlowJob(type="add", payload=1), FlowJob(type="add", payload=2))
        )
        doomed = await q.submit_flow(
            chain(FlowJob(type="fail", payload={"fatal": True}), FlowJob(type="echo"))
        )
        await run_flows(q)
        never = await q.submit(
            "echo", "later", depends_on=[(await q.submit("echo", 0, delay=3600)).job_id]
        )
        ids = [existing.job_id, *fan.ids, *steps.ids, *doomed.ids, never.job_id]
        assert (await q.status(never.job_id)).state is State.WAITING

        entries = [p for e in await log_entries(q.redis, q.keys) for p in parse_entries(*e)]
        persister = Persister(pg_settings, q.redis, pg_pool, "p1")
        assert await persister.drain() == len(entries)
        await assert_pg_matches_redis(q.redis, pg_pool, q.keys, ids)
        assert await pg_pool.fetch(query("history_gaps"), ids) == []  # quiet updates skipped
        rows = await pg_pool.fetch(
            "SELECT job_id, depends_on, position, child FROM job_dependencies ORDER BY job_id, position"
        )
        parent = fan.ids[-1]
        mine = [(r["depends_on"], r["position"], r["child"]) for r in rows if r["job_id"] == parent]
        assert mine == [(k, i, True) for i, k in enumerate(fan.ids[:-1])] + [
            (existing.job_id, 10, False)
        ]
        waiting = await pg_pool.fetchval("SELECT state FROM jobs WHERE id = $1", never.job_id)
        assert waiting == "waiting"
        assert {r["job_id"] for r in rows} == {parent, steps.ids[1], doomed.ids[1], never.job_id}

        reader = PgReader(pg_pool)
        from_pg = await reader.dependencies(parent, "default")
        from_redis = await q.jobs.dependencies(parent)
        assert from_pg == from_redis
        cancelled = await reader.dependencies(doomed.ids[1], "default")
        assert cancelled is not None and cancelled[0].state == "failed"
        assert cancelled[0].error is not None and cancelled[0].error.type == "Fatal"
        assert await reader.dependencies(parent, "another-tenant") is None
        assert await reader.dependencies(existing.job_id, "default") == []
        # replayed entries (a persister died before acknowledging) change nothing
        before = await pg_pool.fetch("SELECT * FROM job_dependencies ORDER BY 1, 2")
        await persister.persist(entries)
        assert await pg_pool.fetch("SELECT * FROM job_dependencies ORDER BY 1, 2") == before
    finally:
        await q.close()
