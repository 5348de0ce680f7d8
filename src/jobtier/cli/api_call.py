"""One request through the Python client (its retries, errors and key) whose JSON answer a
command prints as it is: for the admin routes the client has no method of its own for."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobtier.client import Client


def call_json(
    c: Client, method: str, where: str, body: Any = None, params: dict[str, str] | None = None
) -> Any:
    """``method`` on ``where`` (a path), with ``body`` as JSON: the answer's JSON, or the
    ``ApiError`` it is, raised."""
    from jobtier.client._core import Call, Op, check, json_call

    def op() -> Op[Any]:
        call = Call(method, where) if body is None else json_call(method, where, body)
        response = yield dataclasses.replace(call, params=params)
        check(response)
        return response.json()

    return c._run(op())
