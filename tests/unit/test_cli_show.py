"""`jobtier jobs show`'s text says what it could not read, rather than showing nothing."""

from __future__ import annotations

import argparse
from typing import Any, cast

import msgspec

from jobtier.cli import manage
from jobtier.client import JobDetails
from jobtier.core.model import JobStatus, Priority, State


class Shows:
    """The client seam ``jobs_show`` uses: ``show`` answers these details."""

    def __init__(self, details: JobDetails) -> None:
        self.details = details

    def show(self, job_id: str) -> JobDetails:
        assert job_id == self.details.status.id
        return self.details


def shown(details: JobDetails) -> str:
    args = argparse.Namespace(job_id=details.status.id, json=False)
    return cast(str, manage.jobs_show(cast(Any, Shows(details)), args))


def test_a_result_the_store_could_not_give_is_said_to_be_unavailable() -> None:
    status = JobStatus(
        id="01M8KK4FZ54RBHFVYBN6HBV0CZ-1", type="big", state=State.SUCCEEDED, version=3,
        priority=Priority.NORMAL, attempt=1, max_attempts=3, created_at="", updated_at="",
    )  # fmt: skip
    away = shown(JobDetails(status, None, None, [], "kept in the result store, which is away"))
    assert "result:      not available (kept in the result store, which is away)" in away
    assert "history:     not available" in away
    there = shown(JobDetails(status, {"rows": 2}, [], []))
    assert 'result:      {"rows":2}' in there and "not available" not in there


def test_a_job_that_never_reached_a_queue_shows_no_attempt_count() -> None:
    """An outbox row the relay refused (or has not relayed yet) has no attempts set: it
    showed `attempt: 0 of 0`."""
    refused = JobStatus(
        id="01M8KK4FZ54RBHFVYBN6HBV0CZ-1", type="nobody", state=State.FAILED, version=1,
        priority=Priority.NORMAL, attempt=0, max_attempts=0, created_at="", updated_at="",
    )  # fmt: skip
    text = shown(JobDetails(refused, None, [], []))
    assert "attempt:     none: it never reached a queue" in text and "0 of 0" not in text
    queued = msgspec.structs.replace(refused, state=State.QUEUED, max_attempts=3)
    assert "attempt:     0 of 3" in shown(JobDetails(queued, None, [], []))
