"""The HTTP answer to a status read: the document with its ETag, 304, or the 404 — one
function for the route (api/jobs.py) and the fast path (fastpath.py)."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from jobtier.status.reader import parse_version

Message = dict[str, Any]
"""An ASGI message."""

_NO_CACHE = (b"cache-control", b"no-cache")
_JSON_TYPE = (b"content-type", b"application/json")


def doc_headers(version: int, doc: bytes | None) -> list[tuple[bytes, bytes]]:
    """The raw headers of a status document's answer (``doc`` None: of its 304); every
    answer with a status document sends these."""
    etag = (b"etag", b'"%d"' % version)
    if doc is None:
        return [etag, _NO_CACHE]
    return [etag, _NO_CACHE, (b"content-length", b"%d" % len(doc)), _JSON_TYPE]


def etag_matches(header: bytes, version: int) -> bool:
    """If-None-Match: ``*``, or a list of (weak or strong) tags one of which is ours."""
    text = header.decode("latin-1").strip()
    if text == "*":
        return True
    ours = str(version)
    for tag in text.split(","):
        tag = tag.strip()
        if tag.startswith("W/"):
            tag = tag[2:]
        if tag.strip('"') == ours:
            return True
    return False


def status_answer(
    tenant: str, held: bytes | None, owner: str | None, doc: bytes, version: int
) -> Message | None:
    """The ``http.response.start`` message answering ``tenant``'s read of a job whose status
    the reader found (``owner`` None: nothing): 200 with the document's headers, or 304 (no
    body) when ``held``, the If-None-Match header, names ``version``. None for the 404: an
    unknown job and another tenant's look the same."""
    if owner != tenant:
        return None
    if held is not None and etag_matches(held, version):
        return {"type": "http.response.start", "status": 304, "headers": doc_headers(version, None)}
    return {"type": "http.response.start", "status": 200, "headers": doc_headers(version, doc)}


class StatusResponse(Response):
    """:func:`status_answer`'s message as a Starlette response (the route's answer)."""

    def __init__(self, start: Message, doc: bytes) -> None:
        self.status_code = start["status"]
        self.raw_headers = start["headers"]
        self.body = doc if self.status_code == 200 else b""
        self.background = None


class DocResponse(Response):
    """A status document with its ETag (``version``, else read from the document), and
    ``headers`` (e.g. Location) after them; the answer of a submit or a change, with the
    headers of a status read."""

    media_type = "application/json"

    def __init__(
        self, doc: bytes, version: int | None = None, status_code: int = 200, **headers: str
    ) -> None:
        self.status_code = status_code
        self.background = None
        self.body = doc
        raw = doc_headers(parse_version(doc) if version is None else version, doc)
        for name, value in headers.items():
            raw.append((name.lower().encode("latin-1"), value.encode("latin-1")))
        self.raw_headers = raw
