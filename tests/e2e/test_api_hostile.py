"""Hostile input through a real server: each was once a 500 (with a traceback in the log) or
an answer the OpenAPI document did not describe. Every answer is a problem document and
changes nothing."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from jobtier.api.bounds import MAX_HEADER_BYTES, MAX_HEADERS, MAX_URL_BYTES
from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.core.json_depth import MAX_JSON_DEPTH
from jobtier.engine.queue import Queue
from tests.e2e.test_api_bad_input import snapshot
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import wait_for

PROBLEM = "application/problem+json"
JSON = {"content-type": "application/json"}


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)


@pytest.fixture(autouse=True)
def no_internal_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The server under test runs in this process: an unhandled error would be logged here."""
    with caplog.at_level(logging.WARNING, logger="jobtier.api"):
        yield
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


def problem_of(r: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == PROBLEM
    doc: dict[str, Any] = r.json()
    assert doc["type"] == f"urn:jobtier:problem:{slug}" and doc["status"] == status
    return doc


def nested(depth: int) -> bytes:
    """A JSON array nested ``depth`` deep, as bytes (a client's encoder would recurse)."""
    return b"[" * depth + b"0" + b"]" * depth


# --- 500s from hostile input -----------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/schedules", "/v1/admin/dead-letters"])
@pytest.mark.parametrize("limit", ["%C2%B2", "%D9%A3", "-1", "1.5", "0", "99999999999999999999"])
async def test_a_limit_that_is_not_ascii_digits_in_range_is_a_400(
    pg_api: ApiServer, path: str, limit: str
) -> None:
    async with pg_api.client("admin" if "admin" in path else "acme") as c:
        r = await c.get(f"{path}?limit={limit}")
    doc = problem_of(r, 400, "bad-request")
    assert doc["field"] == "limit" and "limit" in doc["detail"]


async def test_query_parameters_unknown_repeated_or_with_a_nul_are_400s(pg_api: ApiServer) -> None:
    async with pg_api.client() as c:
        for query, field in [
            ("colour=red", "colour"),
            ("limit=2&limit=3", "limit"),
            ("type=a%00b", "type"),
            ("cursor=", "cursor"),
            ("created_after=0001-01-01T00:00:00%2B01:00", "created_after"),
        ]:
            doc = problem_of(await c.get(f"/v1/jobs?{query}"), 400, "bad-request")
            assert doc["field"] == field, query
        doc = problem_of(await c.get("/v1/schedules?after=a%00"), 400, "bad-request")
        assert doc["field"] == "after"


@pytest.mark.parametrize("last_event_id", [b"\xb2", b"1\xff", b"\xd9\xa3"])
async def test_a_non_ascii_last_event_id_is_ignored(api: ApiServer, last_event_id: bytes) -> None:
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo"})).json()
        headers = {b"last-event-id": last_event_id}
        async with c.stream("GET", f"/v1/jobs/{job['id']}/events", headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    assert line == "id: 1"  # the current status, as with no Last-Event-ID
                    break


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/jobs", b'{"type": "echo", "payload": %s}'),
        ("/v1/jobs/batch", b'{"jobs": [{"type": "echo", "payload": %s}]}'),
        ("/v1/schedules", b'{"name": "n", "type": "echo", "interval": 60, "payload": %s}'),
    ],
)
async def test_a_body_nested_too_deep_is_a_422_naming_the_limit(
    pg_api: ApiServer, queue: Queue, path: str, body: bytes
) -> None:
    before = await snapshot(queue)
    outer = 1 if path != "/v1/jobs/batch" else 3  # the body's own object (and list) count
    async with pg_api.client() as c:
        for depth in (1000, 100_000, MAX_JSON_DEPTH - outer + 1):
            r = await c.post(path, content=body % nested(depth), headers=JSON)
            doc = problem_of(r, 422, "validation")
            assert doc["limit"] == MAX_JSON_DEPTH and str(MAX_JSON_DEPTH) in doc["detail"]
        # never closed: malformed, so the count before decoding cannot tell its depth, and
        # the decoder's own recursion gives out first (it was a 500)
        r = await c.post(path, content=body % (b"[" * 100_000), headers=JSON)
        doc = problem_of(r, 422, "validation")
        assert doc["limit"] == MAX_JSON_DEPTH
        assert await snapshot(queue) == before
        r = await c.post(path, content=body % nested(MAX_JSON_DEPTH - outer), headers=JSON)
        assert r.status_code < 300, r.text


async def test_strings_with_brackets_do_not_count_as_nesting(api: ApiServer) -> None:
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "echo", "payload": ["[{" * 500, ']\\"[' * 99]})
        assert r.status_code == 202, r.text


@pytest.mark.parametrize("route", ["/history", "/result", "/cancel", "/events", ""])
@pytest.mark.parametrize("job_id", ["%00", "01M8KK4FZ54RBHFVYBN6HBV0CZ-1%00", "x" * 300, "%FF%FE"])
async def test_a_malformed_job_id_is_a_404_on_every_route(
    pg_api: ApiServer, queue: Queue, route: str, job_id: str
) -> None:
    before = await snapshot(queue)
    async with pg_api.client() as c:
        method = "POST" if route == "/cancel" else "GET"
        problem_of(await c.request(method, f"/v1/jobs/{job_id}{route}"), 404, "not-found")
    async with pg_api.client("admin") as admin:
        r = await admin.post(f"/v1/admin/dead-letters/{job_id}/replay")
        problem_of(r, 404, "not-found")
    assert await snapshot(queue) == before


# --- the app's own URL and header limits, below the server's ---------------------------------
async def test_a_long_url_is_a_414_problem(api: ApiServer) -> None:
    async with api.client() as c:
        doc = problem_of(await c.get("/v1/jobs/" + "A" * MAX_URL_BYTES), 414, "uri-too-long")
        assert str(MAX_URL_BYTES) in doc["detail"]
        r = await c.get("/v1/admin/dead-letters?type=" + "a" * MAX_URL_BYTES)
        problem_of(r, 414, "uri-too-long")


async def test_large_or_many_headers_are_a_431_problem(api: ApiServer) -> None:
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo"})).json()
        r = await c.get(f"/v1/jobs/{job['id']}", headers={"x-filler": "f" * MAX_HEADER_BYTES})
        doc = problem_of(r, 431, "headers-too-large")
        assert str(MAX_HEADER_BYTES) in doc["detail"]
        many = {f"x-h{i}": "1" for i in range(MAX_HEADERS)}
        doc = problem_of(
            await c.get(f"/v1/jobs/{job['id']}", headers=many), 431, "headers-too-large"
        )
        assert str(MAX_HEADERS) in doc["detail"]
        # just under the limits: answered as usual
        r = await c.get(f"/v1/jobs/{job['id']}", headers={"x-filler": "f" * 4000})
        assert r.status_code == 200


# --- answers the OpenAPI document did not describe -------------------------------------------
async def test_wait_out_of_range_is_refused_with_or_without_if_none_match(api: ApiServer) -> None:
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo"})).json()
        for wait in ("-1", "61", "nan", "inf", "1e400", "%C2%B2"):
            for headers in ({}, {"if-none-match": '"1"'}):
                r = await c.get(f"/v1/jobs/{job['id']}?wait={wait}", headers=headers)
                assert problem_of(r, 400, "bad-request")["field"] == "wait"
        assert (await c.get(f"/v1/jobs/{job['id']}?wait=0.5")).status_code == 200


async def test_405_names_every_method_of_the_path_in_allow(pg_api: ApiServer) -> None:
    async with pg_api.client() as c:
        for method, path, allow in [
            ("GET", "/v1/jobs/batch", "POST"),
            ("DELETE", "/v1/jobs", "GET, HEAD, POST"),
            ("PUT", "/v1/schedules", "GET, HEAD, POST"),
            ("POST", "/v1/schedules/01M8KK4FZ54RBHFVYBN6HBV0CZ", "DELETE, GET, HEAD, PATCH"),
            ("DELETE", "/v1/jobs/01M8KK4FZ54RBHFVYBN6HBV0CZ-1", "GET, HEAD"),
            ("PATCH", "/healthz", "GET, HEAD"),
        ]:
            r = await c.request(method, path)
            problem_of(r, 405, "method-not-allowed")
            assert r.headers["allow"] == allow, (method, path)


async def test_a_payload_over_its_limit_is_a_413_naming_the_setting(
    start_api: StartApi, queue: Queue
) -> None:
    api = await start_api(max_payload_bytes=1000, max_request_bytes=5000)
    before = await snapshot(queue)
    async with api.client() as c:
        for path, body in [
            ("/v1/jobs", {"type": "echo", "payload": "x" * 1200}),
            (
                "/v1/jobs/batch",
                {"jobs": [{"type": "echo"}, {"type": "echo", "payload": "x" * 1200}]},
            ),
        ]:
            doc = problem_of(await c.post(path, json=body), 413, "payload-too-large")
            assert "JOBTIER_MAX_PAYLOAD_BYTES" in doc["detail"] and "1000" in doc["detail"]
            assert doc["field"].endswith("payload")
        # the body's own limit, named and quoted as applied
        r = await c.post("/v1/jobs", json={"type": "echo", "payload": "x" * 6000})
        doc = problem_of(r, 413, "payload-too-large")
        assert "JOBTIER_MAX_REQUEST_BYTES" in doc["detail"] and "5000" in doc["detail"]
    assert await snapshot(queue) == before


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("application/notjson", 415),
        ("text/json", 415),
        ("application/json-patch", 415),
        ("application/x/y+json", 415),
        ("application/json; charset=utf-8", 202),
        ("application/merge-patch+json", 202),
        ("APPLICATION/JSON", 202),
    ],
)
async def test_only_json_media_types_are_accepted(
    api: ApiServer, content_type: str, status: int
) -> None:
    async with api.client() as c:
        r = await c.post(
            "/v1/jobs", content=b'{"type": "echo"}', headers={"content-type": content_type}
        )
    assert r.status_code == status, r.text
    if status == 415:
        problem_of(r, 415, "unsupported-media-type")


async def test_a_just_created_jobs_history_is_what_is_persisted_so_far(
    pg_api: ApiServer,
) -> None:
    async with pg_api.client() as c, pg_api.client("globex") as globex:
        job = (await c.post("/v1/jobs", json={"type": "echo"})).json()  # no persister runs
        r = await c.get(f"/v1/jobs/{job['id']}/history")
        assert r.status_code == 200, r.text
        history = r.json()
        assert history["id"] == job["id"] and history["transitions"] == []
        assert set(history["lag"]) == {"transitions", "seconds"}

        async def lag_shows_the_submit() -> bool:  # the lag is measured about once a second
            r = await c.get(f"/v1/jobs/{job['id']}/history")
            return r.status_code == 200 and r.json()["lag"]["transitions"] >= 1

        await wait_for(lag_shows_the_submit)
        # another tenant still sees nothing
        problem_of(await globex.get(f"/v1/jobs/{job['id']}/history"), 404, "not-found")


async def test_an_enum_error_lists_the_valid_values(pg_api: ApiServer) -> None:
    async with pg_api.client() as c:
        for path, body, field in [
            ("/v1/jobs", {"type": "echo", "priority": "urgent"}, "priority"),
            (
                "/v1/jobs/batch",
                {"jobs": [{"type": "echo", "priority": "urgent"}]},
                "jobs[0].priority",
            ),
            (
                "/v1/schedules",
                {"name": "n", "type": "echo", "interval": 60, "misfire": "x"},
                "misfire",
            ),
        ]:
            doc = problem_of(await c.post(path, json=body), 422, "validation")
            assert doc["field"] == field
        assert (
            "critical, high, normal, low"
            in (await c.post("/v1/jobs", json={"type": "echo", "priority": "urgent"})).json()[
                "detail"
            ]
        )
        assert "fire_all, fire_once, skip" in doc["detail"]
