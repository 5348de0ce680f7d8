"""The one answer to a status read (status/answer.py), shared by the route and the fast path:
pure, on what the reader found."""

from __future__ import annotations

import pytest

from jobtier.status.answer import StatusResponse, status_answer

DOC = b'{"id":"x","version":3}'


def test_the_document_with_its_etag() -> None:
    start = status_answer("acme", None, "acme", DOC, 3)
    assert start == {
        "type": "http.response.start",
        "status": 200,
        "headers": [
            (b"etag", b'"3"'),
            (b"cache-control", b"no-cache"),
            (b"content-length", b"%d" % len(DOC)),
            (b"content-type", b"application/json"),
        ],
    }
    assert StatusResponse(start, DOC).body == DOC


@pytest.mark.parametrize("held", [b'"3"', b'W/"2", "3"', b"*", b' "3" '])
def test_a_held_version_is_not_modified(held: bytes) -> None:
    start = status_answer("acme", held, "acme", DOC, 3)
    assert start is not None and start["status"] == 304
    assert start["headers"] == [(b"etag", b'"3"'), (b"cache-control", b"no-cache")]
    assert StatusResponse(start, DOC).body == b""


@pytest.mark.parametrize("held", [b'"2"', b'"33"', b""])
def test_another_version_gets_the_document(held: bytes) -> None:
    start = status_answer("acme", held, "acme", DOC, 3)
    assert start is not None and start["status"] == 200


def test_unknown_and_another_tenants_job_look_the_same() -> None:
    assert status_answer("acme", None, None, b"", 0) is None
    assert status_answer("acme", b"*", "globex", DOC, 3) is None
