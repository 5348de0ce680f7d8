"""What a submit sends: a ``JobSpec`` of ``submit_many`` without the members it leaves unset,
so that an API from before a member (the expiry's, say) takes a job that does not use it
(``forbid_unknown_fields`` refuses a member it does not know, even null); ``submit`` with an
expiry sends the one member it gives."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from typing import Any

import httpx

from jobtier.client import Client
from jobtier.core.model import JobSpec


def _sent(call: Any) -> dict[str, Any]:
    bodies: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"type": "about:blank", "title": "t", "status": 400})

    with Client("http://127.0.0.1:9", "k", retries=0, transport=httpx.MockTransport(answer)) as c:
        try:
            call(c)
        except Exception:  # the answer above: only the body sent matters here
            pass
    (body,) = bodies
    return body


def test_a_jobspec_sends_only_what_it_sets() -> None:
    body = _sent(lambda c: c.submit_many([JobSpec(type="echo", payload=1)]))
    assert body == {"jobs": [{"type": "echo", "payload": 1}]}


def test_an_expiry_is_one_member() -> None:
    assert _sent(lambda c: c.submit("echo", expires=90))["expires_in"] == 90
    body = _sent(lambda c: c.submit("echo", expires=timedelta(minutes=2)))
    assert body["expires_in"] == 120 and "expires_at" not in body
    at = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    body = _sent(lambda c: c.submit("echo", expires=at))
    assert datetime.fromisoformat(body["expires_at"]) == at and "expires_in" not in body
    assert "expires_in" not in _sent(lambda c: c.submit("echo"))


def test_a_timeout_is_sent_as_seconds() -> None:
    assert _sent(lambda c: c.submit("echo", timeout=timedelta(minutes=2)))["timeout"] == 120
    assert _sent(lambda c: c.submit("echo", timeout=1.5))["timeout"] == 1.5
    assert "timeout" not in _sent(lambda c: c.submit("echo"))
    (job,) = _sent(lambda c: c.submit_many([JobSpec(type="echo", timeout=timedelta(seconds=3))]))[  # type: ignore[arg-type]
        "jobs"
    ]
    assert job == {"type": "echo", "timeout": 3}


def test_a_timeout_that_is_no_number_is_refused_naming_it() -> None:
    import pytest

    from jobtier.core.errors import InvalidRequest

    transport = httpx.MockTransport(lambda request: httpx.Response(500))
    with Client("http://127.0.0.1:9", "k", retries=0, transport=transport) as c:
        for bad in ("5", True):
            with pytest.raises(InvalidRequest) as refused:
                c.submit("echo", timeout=bad)  # type: ignore[arg-type]
            assert refused.value.field == "timeout" and "a number of seconds" in str(refused.value)
        with pytest.raises(InvalidRequest) as refused:
            c.submit_many([{"type": "echo", "delay": "soon"}])
        assert refused.value.field == "delay"


def test_a_jobspecs_timedeltas_are_sent_as_seconds() -> None:
    spec = JobSpec(type="echo", delay=timedelta(seconds=5), expires_in=timedelta(minutes=1))  # type: ignore[arg-type]
    (job,) = _sent(
        lambda c: c.submit_many(
            [
                spec,
            ]
        )
    )["jobs"]
    assert job == {"type": "echo", "delay": 5, "expires_in": 60}
    (job,) = _sent(lambda c: c.submit_many([{"type": "echo", "expires_in": timedelta(seconds=2)}]))[
        "jobs"
    ]
    assert job == {"type": "echo", "expires_in": 2}


def test_an_expires_of_another_kind_is_refused_saying_what_it_takes() -> None:
    import pytest

    from jobtier.core.errors import InvalidRequest

    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    transport = httpx.MockTransport(answer)
    with Client("http://127.0.0.1:9", "k", retries=0, transport=transport) as c:
        for bad in ("300", date(2027, 1, 1), True, float("nan")):
            with pytest.raises(InvalidRequest) as refused:
                c.submit("echo", expires=bad)  # type: ignore[arg-type]
            assert refused.value.field == "expires_in"
        with pytest.raises(InvalidRequest, match=r"a datetime \(with a zone\), a timedelta"):
            c.submit("echo", expires="300")  # type: ignore[arg-type]
        # a time without a zone: named as the argument was given, not as the API's field
        with pytest.raises(InvalidRequest, match=r"^expires needs a time zone: 2030-01-02T03:04"):
            c.submit("echo", expires=datetime(2030, 1, 2, 3, 4))
    assert sent == []  # refused before anything was sent


def test_a_flow_jobs_timedelta_delay_is_sent_as_seconds() -> None:
    from jobtier.core.model import FlowJob

    job = FlowJob(ref="a", type="echo", delay=timedelta(seconds=7))  # type: ignore[arg-type]
    body = _sent(
        lambda c: c.submit_flow([job, {"ref": "b", "type": "echo", "delay": timedelta(seconds=3)}])
    )
    assert [j.get("delay") for j in body["jobs"]] == [7, 3]


def test_a_jobspecs_infinite_expiry_is_refused_naming_it() -> None:
    import pytest

    from jobtier.client import Replayed
    from jobtier.core.errors import InvalidRequest

    transport = httpx.MockTransport(lambda request: httpx.Response(500))
    with (
        Client("http://127.0.0.1:9", "k", retries=0, transport=transport) as c,
        pytest.raises(InvalidRequest) as refused,
    ):
        c.submit_many([JobSpec(type="echo", expires_in=float("inf"))])
    assert refused.value.field == "expires_in" and "expires_in must be" in str(refused.value)
    assert Replayed(["a"]).skipped == []  # an answer without the member reads as none
