"""The circuit breakers over HTTP: the admin list, manual open and close (audited), bad input."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.core.breaker import Breaker
from jobtier.engine.queue import Queue
from jobtier.store.breaker_state import WAIT, BreakerStates
from tests.e2e.test_admin_cli import Cli
from tests.fixtures.api import ADMIN, ApiServer, StartApi


def _breaker_state(r: httpx.Response, name: str) -> float:
    """The value of jobtier_breaker_state for ``name`` in a /metrics answer."""
    assert r.status_code == 200, r.text
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    (value,) = [
        s.value for s in families["jobtier_breaker_state"].samples if s.labels["breaker"] == name
    ]
    return float(value)


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)


async def test_open_and_close_by_hand_hold_the_workers_and_are_audited(
    pg_api: ApiServer, queue: Queue
) -> None:
    states = BreakerStates(queue.store)
    b = Breaker("api-mail", failures=2, open_for=1)
    await states.close(b.name, "test start")
    await states.record(b, "f", "", "smtp timeout", "send_mail")  # one failure: it exists now
    async with pg_api.client("admin") as admin, pg_api.client("acme") as acme:
        listed = (await admin.get("/v1/admin/breakers")).json()["breakers"]
        mine = next(x for x in listed if x["name"] == b.name)
        assert mine["state"] == "closed" and mine["thresholds"]["failures"] == 2
        assert mine["thresholds"]["open_ms"] == 1000 and mine["thresholds"]["ratio"] is None
        assert mine["types"] == ["send_mail"]  # the task type that recorded

        r = await admin.post(f"/v1/admin/breakers/{b.name}/open", json={"reason": "smtp upgrade"})
        assert r.status_code == 200, r.text
        opened = r.json()
        assert (opened["state"], opened["manual"], opened["reason"]) == (
            "open",
            True,
            "smtp upgrade",
        )
        assert (await states.admit(b, "w", 5000)).verdict == WAIT  # every worker holds its jobs
        assert _breaker_state(await admin.get("/metrics"), b.name) == 1.0
        r = await admin.post(f"/v1/admin/breakers/{b.name}/open", json={"seconds": 60})
        assert r.json()["open_until"] == pytest.approx(time.time() + 60, abs=5)
        assert r.json()["manual"] is False
        r = await admin.post(f"/v1/admin/breakers/{b.name}/close")
        assert r.status_code == 200 and r.json()["state"] == "closed"
        assert (await states.admit(b, "w", 5000)).runs
        assert _breaker_state(await admin.get("/metrics"), b.name) == 0.0

        assert (await acme.post(f"/v1/admin/breakers/{b.name}/open")).status_code == 403
        page = (await admin.get(f"/v1/admin/audit?target={b.name}")).json()["records"]
        got = [(x["action"], x["status"], x["detail"]) for x in page]
        assert got == [
            ("breaker.close", 200, {"reason": "closed by hand"}),
            ("breaker.open", 200, {"seconds": 60.0, "reason": "opened by hand"}),
            ("breaker.open", 200, {"seconds": None, "reason": "smtp upgrade"}),
        ]


async def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    api: ApiServer, queue: Queue
) -> None:
    states = BreakerStates(queue.store)
    await states.close("api-bad", "test start")
    async with api.client("admin") as admin:
        for path, body, field in (
            ("/v1/admin/breakers/a:b/open", None, "name"),
            ("/v1/admin/breakers/api-bad/open", {"seconds": 0}, "seconds"),
            ("/v1/admin/breakers/api-bad/open", {"seconds": -3}, "seconds"),
            ("/v1/admin/breakers/api-bad/open", {"reason": "x" * 201}, "reason"),
            ("/v1/admin/breakers/api-bad/open", {"seconds": "soon"}, "seconds"),
            ("/v1/admin/breakers/api-bad/close", {"why": "?"}, "why"),  # unknown
        ):
            r = await admin.post(path, json=body)
            assert r.status_code == 422, (path, body, r.text)
            assert r.json().get("field") == field, r.text
        assert (await states.get("api-bad")).state == "closed"
        assert (await admin.get("/v1/admin/breakers/api-bad/open")).status_code == 405


async def test_the_cli_lists_opens_and_closes(pg_api: ApiServer, queue: Queue) -> None:
    cli = Cli(pg_api)
    await BreakerStates(queue.store).close("cli-sms", "test start")
    code, out, err = await cli("breakers", "open", "cli-sms", "--for", "90", key=ADMIN)
    assert code == 0, err
    header, row = out.splitlines()
    assert header.split()[:2] == ["BREAKER", "STATE"] and row.split()[:2] == ["cli-sms", "open"]
    listed = {b["name"]: b for b in await cli.json("breakers", key=ADMIN)}
    assert listed["cli-sms"]["open_until"] == pytest.approx(time.time() + 90, abs=10)
    code, out, _ = await cli("breakers", "open", "cli-sms", "--reason", "vendor outage", key=ADMIN)
    assert code == 0 and "until closed" in out and "vendor outage" in out
    closed = await cli.json("breakers", "close", "cli-sms", key=ADMIN)
    assert closed["state"] == "closed" and closed["reason"] == "closed by hand"
    code, out, _ = await cli("breakers", "list", key=ADMIN)
    assert any(line.split()[:2] == ["cli-sms", "closed"] for line in out.splitlines())
    code, _, err = await cli("breakers", "open", "no:colons", key=ADMIN)
    assert code == 1 and "breaker name must match" in err
    code, _, err = await cli("breakers", "open", "cli-sms", "--for", "-1", key=ADMIN)
    assert code == 2 and "--for" in err
