"""HTTP helpers shared by the API's routes: the status-document response, ETag matching,
and reading a JSON body with its limits and problem documents."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.auth import raw_header
from jobtier.api.problems import Problem
from jobtier.errors import InvalidRequest
from jobtier.model import TERMINAL

JSON = "application/json"


class DocResponse(Response):
    """A status document with its ``ETag`` (or, for 304, the ``ETag`` alone), its headers
    built as bytes in one step.

    It is most of what the API sends (every status read), and Starlette's generic header
    handling (a dict, then lower-casing and encoding each pair) was ~3 us of a ~16 us
    near-cache hit in the ASGI app (bench/results/status_read.md).
    """

    media_type = JSON

    def __init__(self, doc: bytes, version: int, status_code: int = 200, **headers: str) -> None:
        self.status_code = status_code
        self.background = None
        raw = [(b"etag", b'"%d"' % version), (b"cache-control", b"no-cache")]
        if status_code == 304:
            self.body = b""
        else:
            self.body = doc
            raw.append((b"content-length", b"%d" % len(doc)))
            raw.append((b"content-type", b"application/json"))
        for name, value in headers.items():
            raw.append((name.lower().encode("latin-1"), value.encode("latin-1")))
        self.raw_headers = raw


def not_modified(version: int) -> Response:
    return DocResponse(b"", version, 304)


def doc_state(doc: bytes) -> str:
    start = doc.find(b'"state":"') + 9
    return doc[start : doc.find(b'"', start)].decode()


TERMINAL_STATES = frozenset(s.value for s in TERMINAL)


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


# --- body reading ---------------------------------------------------------------------------
async def read_json_body(request: Request, limit: int) -> bytes:
    content_type = raw_header(request, b"content-type")
    if content_type is not None and not content_type.split(b";")[0].strip().lower().endswith(
        b"json"
    ):
        raise Problem(415, "unsupported-media-type", "send the body as application/json")
    length = raw_header(request, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise Problem(413, "payload-too-large", f"the body is over the {limit}-byte limit")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Problem(413, "payload-too-large", f"the body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    if not body:
        raise Problem(400, "invalid-json", "the request has no body; send a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        # msgspec names the offending member: "... - at `$.jobs[1].priority`"
        message = str(exc)
        _, at, path = message.rpartition(" - at `$")
        extra: dict[str, Any] = (
            {"field": path.rstrip("`").lstrip(".")} if at and path.strip("`") else {}
        )
        raise Problem(422, "validation", message, **extra) from None
    except msgspec.DecodeError as exc:
        raise Problem(400, "invalid-json", f"the body is not valid JSON: {exc}") from None


def invalid(exc: InvalidRequest) -> Problem:
    extra: dict[str, Any] = {"field": exc.field} if exc.field else {}
    return Problem(422, "validation", str(exc), **extra)
