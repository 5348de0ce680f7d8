"""Every kind of bad request is a 4xx problem document and changes nothing in Redis."""

from __future__ import annotations

import re
from typing import Any

import pytest

from jobtier.engine.queue import Queue
from tests.fixtures.api import ApiServer

JOB = "01M8KK4FZ54RBHFVYBN6HBV0CZ-1"

# (case, method, path, body or raw bytes, headers, expected status, problem type)
CASES: list[tuple[str, str, str, Any, dict[str, str], int, str]] = [
    ("malformed JSON", "POST", "/v1/jobs", b'{"type": "echo",', {}, 400, "invalid-json"),
    ("lone surrogate", "POST", "/v1/jobs", b'{"type": "echo", "payload": "\\ud800"}', {}, 400, "invalid-json"),
    ("empty body", "POST", "/v1/jobs", b"", {}, 400, "invalid-json"),
    ("not an object", "POST", "/v1/jobs", [1, 2], {}, 422, "validation"),
    ("missing type", "POST", "/v1/jobs", {"payload": 1}, {}, 422, "validation"),
    ("unknown field", "POST", "/v1/jobs", {"type": "echo", "colour": "red"}, {}, 422, "validation"),
    ("wrong type", "POST", "/v1/jobs", {"type": "echo", "max_attempts": "3"}, {}, 422, "validation"),
    ("bad priority", "POST", "/v1/jobs", {"type": "echo", "priority": "urgent"}, {}, 422, "validation"),
    ("bad task name", "POST", "/v1/jobs", {"type": "rm -rf"}, {}, 422, "validation"),
    ("max_attempts 0", "POST", "/v1/jobs", {"type": "echo", "max_attempts": 0}, {}, 422, "validation"),
    ("negative delay", "POST", "/v1/jobs", {"type": "echo", "delay": -5}, {}, 422, "validation"),
    ("far delay", "POST", "/v1/jobs", {"type": "echo", "delay": 1e12}, {}, 422, "validation"),
    ("run_at past", "POST", "/v1/jobs", {"type": "echo", "run_at": "2001-01-01T00:00:00Z"}, {}, 422, "validation"),
    ("run_at far", "POST", "/v1/jobs", {"type": "echo", "run_at": "2999-01-01T00:00:00Z"}, {}, 422, "validation"),
    ("run_at no zone", "POST", "/v1/jobs", {"type": "echo", "run_at": "2030-01-01T00:00:00"}, {}, 422, "validation"),
    ("run_at garbage", "POST", "/v1/jobs", {"type": "echo", "run_at": "tomorrow"}, {}, 422, "validation"),
    ("both times", "POST", "/v1/jobs", {"type": "echo", "delay": 1, "run_at": "2030-01-01T00:00:00Z"}, {}, 422, "validation"),
    ("oversize payload", "POST", "/v1/jobs", {"type": "echo", "payload": "x" * 300_000}, {}, 413, "payload-too-large"),
    ("payload over limit", "POST", "/v1/jobs", {"type": "echo", "payload": "x" * 263_000}, {}, 413, "payload-too-large"),
    ("not JSON content", "POST", "/v1/jobs", b"type=echo", {"content-type": "application/x-www-form-urlencoded"}, 415, "unsupported-media-type"),
    ("bad idempotency key", "POST", "/v1/jobs", {"type": "echo"}, {"idempotency-key": "a b"}, 422, "validation"),
    ("empty batch", "POST", "/v1/jobs/batch", {"jobs": []}, {}, 422, "validation"),
    ("batch not a list", "POST", "/v1/jobs/batch", {"jobs": {"type": "echo"}}, {}, 422, "validation"),
    ("oversize batch", "POST", "/v1/jobs/batch", {"jobs": [{"type": "echo"}] * 1001}, {}, 413, "payload-too-large"),
    ("one bad job in a batch", "POST", "/v1/jobs/batch", {"jobs": [{"type": "echo"}, {"type": "echo", "priority": "x"}]}, {}, 422, "validation"),
    ("bad job id", "GET", "/v1/jobs/not-a-job", None, {}, 404, "not-found"),
    ("foreign shard", "GET", "/v1/jobs/01M8KK4FZ54RBHFVYBN6HBV0CZ-999", None, {}, 404, "not-found"),
    ("unknown job", "GET", f"/v1/jobs/{JOB}", None, {}, 404, "not-found"),
    ("cancel unknown", "POST", f"/v1/jobs/{JOB}/cancel", None, {}, 404, "not-found"),
    ("result unknown", "GET", f"/v1/jobs/{JOB}/result", None, {}, 404, "not-found"),
    ("bad wait", "GET", f"/v1/jobs/{JOB}?wait=x", None, {"if-none-match": '"1"'}, 400, "bad-request"),
    # a query parameter an operation does not take is refused, not ignored
    ("query on a submit", "POST", "/v1/jobs?priority=high", {"type": "echo"}, {}, 400, "bad-request"),
    ("query on a batch", "POST", "/v1/jobs/batch?delay=5", {"jobs": [{"type": "echo"}]}, {}, 400, "bad-request"),
    ("query on a cancel", "POST", f"/v1/jobs/{JOB}/cancel?force=1", None, {}, 400, "bad-request"),
    ("query on log lines", "GET", f"/v1/jobs/{JOB}/logs?limit=1", None, {}, 400, "bad-request"),
]  # fmt: skip


async def snapshot(queue: Queue) -> tuple[int, list[int]]:
    logs = [await queue.redis.xlen(queue.keys.log(s)) for s in range(queue.keys.shards)]
    return await queue.redis.dbsize(), logs


@pytest.mark.parametrize(
    ("case", "method", "path", "body", "headers", "status", "slug"),
    CASES,
    ids=[c[0] for c in CASES],
)
async def test_bad_request(
    api: ApiServer, queue: Queue, case: str, method: str, path: str, body: Any,
    headers: dict[str, str], status: int, slug: str,
) -> None:  # fmt: skip
    before = await snapshot(queue)
    async with api.client() as c:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json", **headers}
            r = await c.request(method, path, content=body, headers=headers)
        elif body is None:
            r = await c.request(method, path, headers=headers)
        else:
            r = await c.request(method, path, json=body, headers=headers)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["type"] == f"urn:jobtier:problem:{slug}"
    assert problem["status"] == status and problem["title"] and problem["detail"]
    assert "Traceback" not in r.text
    assert await snapshot(queue) == before


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"type": "echo", "payload": "\\ud800"}', "no low surrogate in string: line 1 column 30"),
        (b'{"type": "echo", "payload": "abc', "unexpected end of data: line 1 column 33"),
    ],
)
async def test_malformed_json_is_told_as_it_is(api: ApiServer, body: bytes, says: str) -> None:
    """A lone surrogate escape is named, and where it is (msgspec alone calls it "Input data
    was truncated"); a body that is cut short is said to end early, and where."""
    async with api.client() as c:
        r = await c.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert says in r.json()["detail"], r.text


@pytest.mark.parametrize(("member", "value"), [("run_at", "2999-01-01T00:00:00Z"), ("delay", 1e12)])
async def test_too_far_ahead_says_how_far_may_be_and_what_sets_it(
    api: ApiServer, member: str, value: Any
) -> None:
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "echo", member: value})
    assert r.status_code == 422 and r.json()["field"] == member, r.text
    assert "31622400 s (366 days, JOBTIER_MAX_FUTURE_SECONDS)" in r.json()["detail"], r.text


def _filled(path: str) -> str:
    """``path`` with each parameter filled in (a value the router takes; the operation's
    own answer to it does not matter here: the parameter is refused before)."""
    return re.sub(r"{job_id}", JOB, re.sub(r"{(?!job_id)\w+}", "x1", path))


async def test_every_operation_without_query_parameters_refuses_one(
    api: ApiServer, queue: Queue
) -> None:
    """Each operation whose description declares no query parameter answers one with 400
    naming it, and changes nothing: before, most ignored it (``POST /v1/jobs?priority=high``
    queued a job of normal priority, ``…/logs?limit=1`` gave every line)."""
    before = await snapshot(queue)
    checked = []
    async with api.client("admin") as c:
        document = (await c.get("/v1/openapi.json")).json()
        for path, item in document["paths"].items():
            for method, op in item.items():
                if any(p["in"] == "query" for p in op.get("parameters", [])):
                    continue
                r = await c.request(method.upper(), f"{_filled(path)}?bogus=1&bogus=2")
                where = f"{method.upper()} {path}: {r.status_code} {r.text[:200]}"
                assert r.status_code == 400, where
                assert r.json()["field"] == "bogus" and "takes: none" in r.json()["detail"], where
                assert "query parameter" in op["responses"]["400"]["description"], where
                checked.append(f"{method} {path}")
    # submits, cancels, results, admin routes, schedules, workers' routes…: all of them
    assert len(checked) >= 30 and "post /v1/jobs" in checked, checked
    assert await snapshot(queue) == before


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/jobs", {"payload": 1}, "type"),
        ("/v1/jobs", {"type": "echo", "paylod": 1}, "paylod"),
        ("/v1/jobs/batch", {"jobs": [{"type": "echo"}, {"payload": 1}]}, "jobs[1].type"),
        ("/v1/jobs/batch", {"jobs": [{"type": "echo", "colour": "red"}]}, "jobs[0].colour"),
    ],
)
async def test_a_missing_or_unknown_member_is_named(
    api: ApiServer, queue: Queue, path: str, body: Any, field: str
) -> None:
    """The problem's ``field`` names the member missing or not known, as it names one of the
    wrong type: a client shows it beside the right input."""
    before = await snapshot(queue)
    async with api.client() as c:
        r = await c.post(path, json=body)
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    assert await snapshot(queue) == before


async def test_a_trailing_slash_is_redirected_for_a_read_and_named_for_a_write(
    api: ApiServer, queue: Queue
) -> None:
    """``POST /v1/jobs/`` was a 307 with an empty body: nothing for ``curl -X POST`` to show,
    and a client that follows it sends the write again elsewhere. A write is now a 404
    naming the path meant, with nothing done; a read is still sent where it is."""
    before = await snapshot(queue)
    async with api.client() as c:
        r = await c.post("/v1/jobs/", json={"type": "echo"})
        assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
        assert "did you mean /v1/jobs (without the trailing slash)?" in r.json()["detail"]
        assert await snapshot(queue) == before
        r = await c.get(f"/v1/jobs/{JOB}/?wait=1")
        assert r.status_code == 307 and r.headers["location"] == f"/v1/jobs/{JOB}?wait=1"
        r = await c.get("/v1/nowhere/")
        assert r.status_code == 404 and "did you mean" not in r.json()["detail"]
