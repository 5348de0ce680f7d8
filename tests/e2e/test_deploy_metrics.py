"""deploy/'s rules and dashboard against what jobtier really serves: an API with Postgres (the
write-behind lag) and webhooks on (the dispatchers' lag), a worker and a persister that have
seen jobs succeed, fail, retry, go to the dead-letter set and be cancelled.

- The metric names both use are names a real /metrics serves: a renamed metric, or one no
  part of jobtier produces, fails here; and so does a series in the rules' promtool tests
  labelled otherwise than /metrics labels it (their `by` and `on` clauses would then be tested
  on series that never occur).
- A real Prometheus (Debian's, beside promtool) scrapes that API, loads the rules and
  evaluates them without error, and answers every panel's query with data.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.dev.local_redis import free_port
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import MetricsPublisher
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.webhooks.callbacks import ensure_group
from jobtier.worker.runner import Worker
from tests.deploy_files import (
    DASHBOARD_VARIABLES,
    PROMETHEUS_OWN,
    RULES,
    dashboard_exprs,
    dashboard_metric_names,
    load_dashboard,
    load_rules,
    rule_metric_names,
    rules_test_series_labels,
)
from tests.fixtures.api import ADMIN, ApiServer, StartApi
from tests.fixtures.engine import wait_for, worker_for
from tests.tasks import registry

HANG_GUARD = 60.0  # s: only stops a broken test from hanging


async def busy_api(
    start_api: StartApi, pg_settings: Settings, queue: Queue, persister: Persister
) -> tuple[ApiServer, Worker]:
    """An API with Postgres and webhooks on, after a worker and a persister have seen every
    kind of outcome."""
    api = await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)
    await ensure_group(queue.redis, queue.keys, start="$")  # as the first webhook's accept does
    async with api.client() as c:
        for kind in ("echo", "permanent", "flaky"):  # succeeds; dead-lettered; fails, retried
            assert (await c.post("/v1/jobs", json={"type": kind})).status_code == 202
        later = (await c.post("/v1/jobs", json={"type": "echo", "delay": 3600})).json()
        assert (await c.post(f"/v1/jobs/{later['id']}/cancel")).status_code == 200
        await c.get(f"/v1/jobs/{later['id']}")  # a status read
    worker = worker_for(queue, registry, burst=True)
    await worker.run()
    assert await persister.drain() > 0
    return api, worker


async def test_the_rules_and_the_dashboard_use_metrics_jobtier_exports(
    start_api: StartApi, pg_settings: Settings, queue: Queue, pg_pool: Pool
) -> None:
    persister = Persister(pg_settings, queue.redis, pg_pool, "test-persister")
    api, worker = await busy_api(start_api, pg_settings, queue, persister)
    for role, part in (("worker", worker), ("persister", persister)):
        await MetricsPublisher(queue.redis, queue.keys, role, [part]).publish()
    async with api.client("admin") as admin:
        r = await admin.get("/metrics")
    assert r.status_code == 200
    families = list(text_string_to_metric_families(r.text))
    samples = [s for f in families for s in f.samples]
    exported = {s.name for s in samples}
    # each family says what it counts: a HELP that is only its own name says nothing
    bare = sorted(f.name for f in families if re.fullmatch(r"[a-z_]+", f.documentation))
    assert not bare, f"families whose HELP is their name: {bare}"
    for what, used in (
        ("rules", rule_metric_names(load_rules())),
        ("dashboard", dashboard_metric_names(load_dashboard())),
    ):
        assert used, what
        assert not used - exported, f"the {what} use names /metrics lacks: {used - exported}"
    for name, fed in rules_test_series_labels().items():
        if name in PROMETHEUS_OWN:
            continue
        real = {frozenset(s.labels) for s in samples if s.name == name}
        assert fed <= real, f"{name}: the rules' tests label it {fed}, /metrics {real}"


def prometheus_config(folder: Path, api: ApiServer) -> Path:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": DASHBOARD_VARIABLES["$job"],
                "authorization": {"credentials": ADMIN},
                "static_configs": [{"targets": [urlsplit(api.url).netloc]}],
            }
        ],
    }
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_a_real_prometheus_loads_the_rules_and_answers_every_panel(
    start_api: StartApi, pg_settings: Settings, queue: Queue, pg_pool: Pool, tmp_path: Path
) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not on PATH: scripts/system-deps.sh installs it")
    persister = Persister(pg_settings, queue.redis, pg_pool, "test-persister")
    api, worker = await busy_api(start_api, pg_settings, queue, persister)
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={prometheus_config(tmp_path, api)}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        async with (
            # the snapshots stay fresh while Prometheus scrapes (a stale one leaves /metrics)
            MetricsPublisher(queue.redis, queue.keys, "worker", [worker]),
            MetricsPublisher(queue.redis, queue.keys, "persister", [persister]),
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as prom,
        ):

            async def query(expr: str) -> dict[str, Any]:
                body: dict[str, Any] = (
                    await prom.get("/api/v1/query", params={"query": expr})
                ).json()
                return body

            async def ready() -> bool:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
                try:
                    return (await prom.get("/-/ready")).status_code == 200
                except httpx.TransportError:
                    return False  # not listening yet

            async def scraped_twice() -> bool:  # a rate() needs two samples
                result = (await query("count_over_time(jobtier_workers[5m])"))["data"]["result"]
                return bool(result) and float(result[0]["value"][1]) >= 2

            async def rules() -> list[dict[str, Any]]:
                groups = (await prom.get("/api/v1/rules")).json()["data"]["groups"]
                return [rule for group in groups for rule in group["rules"]]

            async def evaluated() -> bool:
                return all(rule["health"] != "unknown" for rule in await rules())

            await wait_for(ready, timeout=HANG_GUARD, interval=0.1)
            await wait_for(scraped_twice, timeout=HANG_GUARD, interval=0.2)
            for where, expr in dashboard_exprs(load_dashboard()):
                found = await query(expr)
                assert found["status"] == "success" and found["data"]["result"], (where, found)
            await wait_for(evaluated, timeout=HANG_GUARD, interval=0.2)
            loaded = await rules()
            assert {rule["name"] for rule in loaded} == {rule["alert"] for rule in load_rules()}
            assert [(r["name"], r["lastError"]) for r in loaded if r["health"] != "ok"] == []
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        log.close()
