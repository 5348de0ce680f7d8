"""What ``replay_dead_letters`` sends: ``"all": true`` only when asked (an API from before
``all`` refuses a field it does not know, so a filtered replay must not carry it)."""

from __future__ import annotations

import json

import httpx

from jobtier.client import Client


def _sent(**kwargs: object) -> dict[str, object]:
    bodies: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"replayed": [], "count": 0})

    with Client("http://127.0.0.1:9", "k", transport=httpx.MockTransport(answer)) as c:
        assert c.replay_dead_letters(**kwargs) == []  # type: ignore[arg-type]
    (body,) = bodies
    return body


def test_a_filtered_replay_sends_no_all() -> None:
    assert _sent(type="resize") == {"limit": 100, "type": "resize"}


def test_every_dead_letter_is_asked_for_by_name() -> None:
    assert _sent(all=True) == {"limit": 100, "all": True}
