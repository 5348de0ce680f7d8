"""/metrics through a real server: every process's series, and the live gauges."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import MetricsPublisher
from jobtier.scheduler import Scheduler
from tests.fixtures.api import ApiServer
from tests.fixtures.engine import worker_for
from tests.tasks import registry


async def test_metrics_show_workers_api_and_queue_gauges(api: ApiServer, queue: Queue) -> None:
    async with api.client() as c, api.client("admin") as admin, api.client(None) as anon:
        assert (await anon.get("/metrics")).status_code == 401  # admin key unless public
        for _ in range(5):
            job = (await c.post("/v1/jobs", json={"type": "echo"})).json()
            await c.get(f"/v1/jobs/{job['id']}")
        await c.post("/v1/jobs", json={"type": "echo", "priority": "high"})
        worker = worker_for(queue, registry, burst=True)
        await worker.run()
        await MetricsPublisher(queue.redis, queue.keys, "worker", [worker]).publish()
        scheduler = Scheduler(queue.store)
        await MetricsPublisher(queue.redis, queue.keys, "scheduler", [scheduler]).publish()
        await c.post("/v1/jobs", json={"type": "echo", "priority": "low"})  # left waiting
        keyed = {"type": "echo", "queue": "keyed", "concurrency_key": "k"}
        for _ in range(3):  # one ready, two held behind their key
            await c.post("/v1/jobs", json=keyed)
        r = await admin.get("/metrics")
        # a queue held back (a task's RateLimited): the seconds left of its block
        before = time.time()
        await queue.admin.block("default", 600)
        blocked = await admin.get("/metrics")
        after = time.time()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    started = [
        s for s in families["jobtier_worker_jobs_started"].samples if s.name.endswith("_total")
    ]
    assert [s.value for s in started] == [6.0] and started[0].labels["role"] == "worker"
    requests = [s for s in families["jobtier_status_requests"].samples if s.name.endswith("_total")]
    assert requests[0].value >= 5 and requests[0].labels["role"] == "api"
    depth = {
        (s.labels["queue"], s.labels["priority"]): s.value
        for s in families["jobtier_queue_depth"].samples
        if s.value
    }
    # the keyed queue's depth is its one ready job: those held behind the key are apart
    assert depth == {("default", "low"): 1, ("keyed", "normal"): 1}
    assert families["jobtier_oldest_queued_age_seconds"].samples
    waits = [s for s in families["jobtier_claim_wait_seconds"].samples if s.name.endswith("_count")]
    assert waits[0].value == 6
    # the burst worker has finished and signed off: no live worker is left
    assert [s.value for s in families["jobtier_workers"].samples] == [0.0]
    # every series says what it counts: no HELP is only the metric's own name
    assert "jobtier_scheduler_promoted" in families
    bare = [f.name for f in families.values() if " " not in f.documentation]
    assert bare == [], bare
    assert gauge(r.text, "jobtier_queue_held_jobs") == {"default": 0.0, "keyed": 2.0}
    assert gauge(r.text, "jobtier_queue_blocked_seconds")["default"] == 0.0
    left = gauge(blocked.text, "jobtier_queue_blocked_seconds")["default"]
    assert 600 - (after - before) - 1 <= left <= 600, left  # (Redis's clock against ours: 1 s)


def gauge(text: str, name: str) -> dict[str, float]:
    """A per-queue gauge's samples by queue."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["queue"]: s.value for s in families[name].samples}
