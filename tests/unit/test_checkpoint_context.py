"""ctx.checkpoint without Redis: jobtier.testing runs a task that saves and resumes, with the
worker's size limit and errors."""

from __future__ import annotations

from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.testing import run_task, run_task_sync
from tests.checkpoint_tasks import chunked, oversized


async def test_the_states_saved_are_in_the_outcome_and_a_resumed_attempt_starts_from_one() -> None:
    first = await run_task(chunked, {"chunks": 3}, attempt=1)
    assert first.state == "succeeded"
    assert first.checkpoints == [
        {"next": 1, "sum": 0},
        {"next": 2, "sum": 1},
        {"next": 3, "sum": 3},
    ]
    assert first.result["resumed"] is False and first.result["ran"] == [0, 1, 2]

    again = await run_task(chunked, {"chunks": 5}, attempt=2, checkpoint=first.checkpoints[-1])
    assert again.result == {
        "attempt": 2,
        "resumed": True,
        "resumed_from": 3,
        "ran": [3, 4],
        "sum": 10,
    }


async def test_an_oversized_state_fails_the_attempt_for_good_naming_the_limit() -> None:
    outcome = await run_task(oversized, 200, settings=Settings(checkpoint_max_bytes=100))
    assert outcome.state == "failed"  # Fatal: no retry would make it fit
    assert outcome.error is not None and outcome.error.type == "CheckpointTooLarge"
    assert "202 bytes" in outcome.error.message and "the limit is 100" in outcome.error.message
    assert outcome.checkpoints == []


async def test_a_state_that_is_not_json_is_a_type_error() -> None:
    async def saves_an_object(ctx: Any, payload: Any) -> None:
        await ctx.checkpoint(object())

    outcome = await run_task(saves_an_object)
    assert outcome.error is not None and outcome.error.type == "TypeError"
    assert "not JSON-serialisable" in outcome.error.message


def test_a_sync_task_is_told_to_save_from_an_async_one() -> None:
    def sync_saver(ctx: Any, payload: Any) -> None:
        ctx.checkpoint({"next": 1})

    outcome = run_task_sync(sync_saver)
    assert outcome.error is not None and outcome.error.type == "RuntimeError"
    assert "await it from an async task" in outcome.error.message


@pytest.mark.parametrize("state", [None, 0, "", [], {}])
async def test_a_falsy_state_is_still_handed_over(state: Any) -> None:
    async def reads(ctx: Any, payload: Any) -> Any:
        return [ctx.checkpoint.resumed, ctx.checkpoint.state]

    outcome = await run_task(reads, checkpoint=state)
    # None is "no checkpoint" (a JSON null saved reads back the same way)
    assert outcome.result == [state is not None, state]
