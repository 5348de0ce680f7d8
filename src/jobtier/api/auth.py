"""API keys: ``Authorization: Bearer <key>`` maps to a tenant; admin routes need the admin key.

Headers are read from the raw ASGI scope: this runs on every status read.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.requests import Request

from jobtier.api.problems import Problem

_BEARER = b"bearer "


def raw_header(request: Request, name: bytes) -> bytes | None:
    for key, value in request.scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def bearer_key(header: bytes | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header; None for none or another scheme."""
    if header is None or header[:7].lower() != _BEARER:
        return None
    return header[7:].strip().decode("latin-1")


def _key_of(header: bytes | None) -> str:
    key = bearer_key(header)
    if key is None:
        raise _unauthorized("send an API key as 'Authorization: Bearer <key>'")
    return key


def _unauthorized(detail: str) -> Problem:
    return Problem(
        401, "unauthorized", detail, headers={"www-authenticate": 'Bearer realm="jobtier"'}
    )


def known_tenant(tenants: dict[str, str], header: bytes | None) -> str | None:
    """The tenant of a ``Bearer`` key in an ``Authorization`` header; None for none or an
    unknown key (the caller then answers 401 through ``tenant_for``)."""
    key = bearer_key(header)
    return None if key is None else tenants.get(key)


def tenant_for(
    tenants: dict[str, str],
    header: bytes | None,
    admin: str = "",
    worker_keys: Sequence[str] = (),
) -> str:
    """The tenant of an ``Authorization`` header's API key, or a 401 problem (403 for the
    admin key ``admin`` or one of ``worker_keys``: known, but not a tenant's)."""
    key = _key_of(header)
    tenant = tenants.get(key)
    if tenant is None:
        if admin and hmac.compare_digest(key.encode(), admin.encode()):
            raise Problem(
                403,
                "forbidden",
                "this route needs a tenant's key (one of JOBTIER_API_KEYS), not the admin key",
            )
        if _is_worker_key(worker_keys, key):
            raise _worker_key_here("a tenant's key (one of JOBTIER_API_KEYS)")
        raise _unauthorized("unknown API key")
    return tenant


def tenant_of(request: Request) -> str:
    """The tenant of the request's API key, or a 401 problem (403 for the admin key or a
    worker's)."""
    state = request.state
    header = raw_header(request, b"authorization")
    return tenant_for(state.tenants, header, state.admin_key, state.worker_keys)


def require_admin(request: Request) -> None:
    """A 401 problem unless the request carries the admin key (403 for a tenant's key or a
    worker's)."""
    key = _key_of(raw_header(request, b"authorization"))
    admin: str = request.state.admin_key
    if not admin or not hmac.compare_digest(key.encode(), admin.encode()):
        if key in request.state.tenants:
            raise Problem(403, "forbidden", "this route needs the admin key")
        if _is_worker_key(request.state.worker_keys, key):
            raise _worker_key_here("the admin key")
        raise Problem(401, "unauthorized", "unknown API key")


def _is_worker_key(worker_keys: Sequence[str], key: str) -> bool:
    return bool(key) and any(hmac.compare_digest(key.encode(), k.encode()) for k in worker_keys)


def _worker_key_here(needed: str) -> Problem:
    """A worker's key on another route: known, but only for the /v1/worker routes."""
    detail = f"this route needs {needed}: a worker key serves the /v1/worker routes only"
    return Problem(403, "forbidden", detail)
