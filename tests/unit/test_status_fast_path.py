"""Which requests the status fast path (status/fastpath.py) takes ahead of Starlette
(``match``): pure, on ASGI scopes; its answers against the route's are compared over HTTP
in tests/e2e/test_api.py."""

from __future__ import annotations

from typing import Any

import pytest

from jobtier.api.bounds import MAX_HEADER_BYTES, MAX_HEADERS, MAX_URL_BYTES
from jobtier.api.jobs import status_fast_path

JOB = "01M8PR73G5B43M9V4VJ335A99S-3"
FAST_PATH = status_fast_path({"key-acme": "acme"})


def scope(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "type": "http",
        "method": "GET",
        "path": f"/v1/jobs/{JOB}",
        "raw_path": f"/v1/jobs/{JOB}".encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"api"), (b"authorization", b"Bearer key-acme")],
    }
    base.update(changes)
    return base


def test_a_plain_status_read_is_taken() -> None:
    assert FAST_PATH.match(scope()) == (JOB, "acme", None)
    held = scope(headers=[(b"if-none-match", b'"3"'), (b"authorization", b"bearer  key-acme")])
    assert FAST_PATH.match(held) == (JOB, "acme", b'"3"')
    # the first of a repeated header wins, as raw_header() reads it
    twice = scope(headers=[(b"authorization", b"Bearer key-acme"), (b"authorization", b"x")])
    assert FAST_PATH.match(twice) == (JOB, "acme", None)
    # no root_path key at all (a server that leaves it out)
    bare = scope()
    del bare["root_path"], bare["raw_path"]
    assert FAST_PATH.match(bare) == (JOB, "acme", None)


@pytest.mark.parametrize(
    "changes",
    [
        {"type": "websocket"},
        {"method": "HEAD"},
        {"method": "POST"},
        {"query_string": b"wait=5"},  # long-poll
        {"root_path": "/api"},
        {"path": "/v1/jobs/"},
        {"path": "/v1/jobs/batch"},
        {"path": f"/v1/jobs/{JOB}/result"},
        {"path": f"/v1/jobs/{JOB}/"},
        {"path": f"/v1/jobsx/{JOB}"},
        {"headers": [(b"host", b"api")]},  # no key: the router's 401
        {"headers": [(b"authorization", b"Bearer unknown")]},
        {"headers": [(b"authorization", b"Basic a2V5LWFjbWU=")]},
        {"raw_path": b"/v1/jobs/" + b"x" * MAX_URL_BYTES},  # RequestLimits' 414
        {"headers": [(b"authorization", b"Bearer key-acme"), (b"x", b"y" * MAX_HEADER_BYTES)]},
        {"headers": [(b"authorization", b"Bearer key-acme")] + [(b"x", b"1")] * MAX_HEADERS},
    ],
)
def test_everything_else_is_left_to_the_app(changes: dict[str, Any]) -> None:
    assert FAST_PATH.match(scope(**changes)) is None
