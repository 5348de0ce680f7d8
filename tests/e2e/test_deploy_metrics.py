"""The metric names deploy/'s alerting rules and dashboard use are names a real /metrics
serves: an API with Postgres (the write-behind lag), a worker and a persister that have seen
jobs succeed, fail, retry, go to the dead-letter set and be cancelled. A renamed metric, or
one no part of jobtier produces, fails here."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import MetricsPublisher
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from tests.deploy_files import (
    dashboard_metric_names,
    load_dashboard,
    load_rules,
    rule_metric_names,
)
from tests.fixtures.api import StartApi
from tests.fixtures.engine import worker_for
from tests.tasks import registry


async def test_the_rules_and_the_dashboard_use_metrics_jobtier_exports(
    start_api: StartApi, pg_settings: Settings, queue: Queue, pg_pool: Pool
) -> None:
    api = await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)
    persister = Persister(pg_settings, queue.redis, pg_pool, "test-persister")
    async with api.client() as c, api.client("admin") as admin:
        for kind in ("echo", "permanent", "flaky"):  # succeeds; dead-lettered; fails, retried
            assert (await c.post("/v1/jobs", json={"type": kind})).status_code == 202
        later = (await c.post("/v1/jobs", json={"type": "echo", "delay": 3600})).json()
        assert (await c.post(f"/v1/jobs/{later['id']}/cancel")).status_code == 200
        await c.get(f"/v1/jobs/{later['id']}")  # a status read
        worker = worker_for(queue, registry, burst=True)
        await worker.run()
        assert await persister.drain() > 0
        for role, part in (("worker", worker), ("persister", persister)):
            await MetricsPublisher(queue.redis, queue.keys, role, [part]).publish()
        r = await admin.get("/metrics")
    assert r.status_code == 200
    exported = {s.name for f in text_string_to_metric_families(r.text) for s in f.samples}
    for what, used in (
        ("rules", rule_metric_names(load_rules())),
        ("dashboard", dashboard_metric_names(load_dashboard())),
    ):
        assert used, what
        assert not used - exported, f"the {what} use names /metrics lacks: {used - exported}"
