"""jobtier.testing.task_run: one attempt in this process, decided by the worker's own code."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import msgspec
import pytest

from jobtier.config import Settings
from jobtier.core.errors import Cancelled, Fatal, InvalidRequest, Retry
from jobtier.core.model import Dependency, JobError
from jobtier.core.names import JOB_ID_RE
from jobtier.testing import Outcome, run_task, run_task_sync, start_task
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import task

# --- tasks ------------------------------------------------------------------------------------


@task(retries=2)
async def describe(ctx: JobContext, payload: Any) -> dict[str, Any]:
    return {
        "job_id": ctx.job_id,
        "attempt": ctx.attempt,
        "max_attempts": ctx.max_attempts,
        "type": ctx.type,
        "payload": payload,
        "pair": (1, 2),  # a tuple: comes back as a list, as a client reads it
    }


@task
async def report_async(ctx: JobContext, payload: Any) -> str:
    for i in range(payload["n"]):
        ctx.progress({"done": i})
        await asyncio.sleep(0)
    return "done"


@task
def report_sync(ctx: JobContext, payload: Any) -> int:
    for i in range(payload["n"]):
        ctx.progress(i)
    return threading.get_ident()


class Boom(Exception):
    pass


class Permanent(Exception):
    pass


@task(retries=4, backoff_base=0.5, backoff_factor=2.0, jitter=0.0)
async def flaky(ctx: JobContext, payload: Any) -> None:
    raise Boom(f"attempt {ctx.attempt} fails")


@task(retries=4, backoff_base=2.0, backoff_factor=3.0, backoff_cap=10.0, jitter=0.5)
async def flaky_jitter(ctx: JobContext, payload: Any) -> None:
    raise Boom("again")


@task(retries=3, backoff_base=60.0)
async def retry_soon(ctx: JobContext, payload: Any) -> None:
    raise Retry("come back soon", delay=0.25)


@task(retries=5)
async def fatal(ctx: JobContext, payload: Any) -> None:
    raise Fatal("the image is corrupt")


@task(retries=5, non_retryable=[Permanent])
async def permanent(ctx: JobContext, payload: Any) -> None:
    raise Permanent("cannot ever work")


@task(retries=1, timeout=0.05)
async def hangs(ctx: JobContext, payload: Any) -> None:
    await asyncio.Event().wait()  # never set: only the task's timeout ends it


@task
async def returns(ctx: JobContext, payload: Any) -> Any:
    return payload["value"] if payload["kind"] == "json" else object()


@task
async def big(ctx: JobContext, payload: int) -> str:
    return "x" * payload


# --- success, context, progress ---------------------------------------------------------------


async def test_success_gives_the_result_as_a_client_reads_it_and_a_real_context() -> None:
    outcome = await run_task(describe, {"image": "a.png"}, attempt=2)
    assert outcome.state == "succeeded" and outcome.error is None and outcome.retry_in is None
    result = outcome.result
    assert result["payload"] == {"image": "a.png"} and result["pair"] == [1, 2]
    assert (result["attempt"], result["max_attempts"], result["type"]) == (2, 3, "describe")
    assert JOB_ID_RE.fullmatch(result["job_id"]) and result["job_id"] == outcome.job_id
    assert (outcome.attempt, outcome.max_attempts) == (2, 3)


async def test_job_id_and_max_attempts_can_be_given() -> None:
    outcome = await run_task(describe, None, job_id="order-42", attempt=5, max_attempts=9)
    assert outcome.result["job_id"] == "order-42"
    assert (outcome.result["attempt"], outcome.result["max_attempts"]) == (5, 9)


async def test_every_progress_report_in_order_from_an_async_task() -> None:
    outcome = await run_task(report_async, {"n": 50})
    assert outcome.state == "succeeded" and outcome.result == "done"
    assert outcome.progress == [{"done": i} for i in range(50)]


async def test_a_sync_task_runs_in_a_thread_and_its_progress_arrives_in_order() -> None:
    outcome = await run_task(report_sync, {"n": 500})
    assert outcome.state == "succeeded"
    assert outcome.result != threading.get_ident()  # not the event loop's thread
    assert outcome.progress == list(range(500))


async def test_a_plain_function_is_taken_as_a_task() -> None:
    async def plain(ctx: JobContext, payload: Any) -> str:
        return f"{ctx.type}:{payload}"

    outcome = await run_task(plain, 7)
    assert (outcome.state, outcome.result) == ("succeeded", "plain:7")


async def test_none_is_a_result_too() -> None:
    outcome = await run_task(returns, {"kind": "json", "value": None})
    assert outcome.state == "succeeded" and outcome.result is None


def test_the_sync_variant_runs_its_own_loop() -> None:
    outcome = run_task_sync(report_sync, {"n": 3})
    assert outcome.state == "succeeded" and outcome.progress == [0, 1, 2]


async def test_the_sync_variant_refuses_to_run_inside_a_loop() -> None:
    with pytest.raises(RuntimeError, match="await run_task"):
        run_task_sync(report_sync, {"n": 3})


async def test_a_payload_a_submit_would_refuse_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="payload"):
        await run_task(describe, {"not json": object()})
    small = Settings.from_env({}, max_payload_bytes=10)
    with pytest.raises(InvalidRequest, match="limit is 10"):
        await run_task(describe, "x" * 20, settings=small)
    with pytest.raises(ValueError, match="attempt must be between 1 and max_attempts"):
        await run_task(describe, None, attempt=4)  # describe has 3 attempts


# --- failures and the retry decision ----------------------------------------------------------


async def test_a_failure_is_retried_after_the_policy_delay() -> None:
    # base 0.5, factor 2, no jitter: attempt n waits 0.5 * 2 ** (n - 1)
    for attempt, delay in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0)]:
        outcome = await run_task(flaky, None, attempt=attempt)
        assert outcome.state == "retry", attempt
        assert outcome.retry_in == delay
        assert outcome.error is not None and outcome.error.retryable
        assert (outcome.error.type, outcome.error.message) == ("Boom", f"attempt {attempt} fails")
        assert outcome.error.traceback is not None
        assert "in flaky" in outcome.error.traceback and "Boom" in outcome.error.traceback
        assert isinstance(outcome.error.exception, Boom)


async def test_the_policy_delay_has_its_jitter_and_cap() -> None:
    # base 2, factor 3, cap 10, jitter 0.5: attempt 2 waits 6 to 9 s, attempt 3 is capped
    for attempt, plain in [(1, 2.0), (2, 6.0), (3, 10.0), (4, 10.0)]:
        outcome = await run_task(flaky_jitter, None, attempt=attempt)
        assert outcome.retry_in is not None
        assert plain <= outcome.retry_in <= plain * 1.5, (attempt, outcome.retry_in)


async def test_the_last_attempt_dead_letters_a_retryable_failure() -> None:
    outcome = await run_task(flaky, None, attempt=5)  # retries=4: 5 attempts
    assert outcome.state == "failed" and outcome.retry_in is None
    assert outcome.error is not None and outcome.error.retryable  # retryable, but none left
    assert (await run_task(flaky, None, attempt=1, max_attempts=1)).state == "failed"


async def test_retry_with_a_delay_overrides_the_policy() -> None:
    outcome = await run_task(retry_soon, None)
    assert outcome.state == "retry" and outcome.retry_in == 0.25
    assert outcome.error is not None and outcome.error.type == "Retry"
    assert (await run_task(retry_soon, None, attempt=4)).state == "failed"  # none left


async def test_fatal_and_non_retryable_go_to_the_dead_letters_at_once() -> None:
    for t, kind, message in [
        (fatal, "Fatal", "the image is corrupt"),
        (permanent, "Permanent", "cannot ever work"),
    ]:
        outcome = await run_task(t, None, attempt=1)
        assert outcome.state == "failed" and outcome.retry_in is None, kind
        assert outcome.error is not None and not outcome.error.retryable
        assert (outcome.error.type, outcome.error.message) == (kind, message)


async def test_a_timed_out_attempt_is_a_retryable_failure() -> None:
    outcome = await run_task(hangs, None)
    assert outcome.state == "retry"
    assert outcome.error is not None
    assert (outcome.error.type, outcome.error.message) == (
        "TimeoutError",
        "attempt timed out after 0.05s",
    )
    assert (await run_task(hangs, None, attempt=2)).state == "failed"  # retries=1


async def test_a_sync_task_times_out_too_and_its_thread_runs_on() -> None:
    release = threading.Event()
    finished = threading.Event()

    @task(timeout=0.05)
    def blocks(ctx: JobContext, payload: Any) -> None:
        release.wait(60)
        finished.set()

    outcome = await run_task(blocks, None)
    assert outcome.state == "retry" and outcome.error is not None
    assert outcome.error.type == "TimeoutError"
    assert not finished.is_set()  # as in a worker: a thread cannot be interrupted
    release.set()
    assert await asyncio.to_thread(finished.wait, 30)


async def test_results_the_job_cannot_keep_are_dead_lettered() -> None:
    outcome = await run_task(returns, {"kind": "object"})
    assert outcome.state == "failed" and outcome.error is not None
    assert outcome.error.type == "ResultNotSerialisable" and not outcome.error.retryable
    assert "not JSON-serialisable" in outcome.error.message

    small = Settings.from_env({}, max_result_bytes=100)
    fits = await run_task(big, 98, settings=small)  # 98 x's and two quotes
    assert fits.state == "succeeded" and fits.result == "x" * 98
    outcome = await run_task(big, 99, settings=small)
    assert outcome.state == "failed" and outcome.error is not None
    assert outcome.error.type == "ResultTooLarge" and not outcome.error.retryable
    assert outcome.error.message == "result is 101 bytes; limit 100"


# --- cancellation -----------------------------------------------------------------------------


async def test_cancel_an_async_task_waiting_for_it() -> None:
    seen: list[str] = []

    @task
    async def waits(ctx: JobContext, payload: Any) -> str:
        ctx.progress("started")
        try:
            await ctx.wait_cancelled()
        except asyncio.CancelledError:
            seen.append(f"cancelled, flag {ctx.cancel_requested}")
            raise
        return "never"

    outcome = await run_task(waits, None, cancel_after_progress=1)
    assert outcome.state == "cancelled" and outcome.progress == ["started"]
    assert outcome.result is None and outcome.error is None
    assert seen == ["cancelled, flag True"]


async def test_cancel_a_sync_task_polling_for_it() -> None:
    @task
    def polls(ctx: JobContext, payload: Any) -> str:
        ctx.progress(1)
        for _ in range(60_000):  # bound: a broken test ends, it does not hang
            ctx.check_cancelled()
            time.sleep(0.001)
        return "never saw the cancel"

    outcome = await run_task(polls, None, cancel_after_progress=1)
    assert outcome.state == "cancelled" and outcome.progress == [1]


async def test_cancel_through_the_handle_at_any_point() -> None:
    @task
    async def steps(ctx: JobContext, payload: Any) -> None:
        for i in range(1_000_000):
            ctx.progress(i)
            await asyncio.sleep(0.001)

    run = start_task(steps, None)
    assert await run.wait_progress(3) == [0, 1, 2]
    run.cancel()
    outcome = await run
    assert outcome.state == "cancelled" and outcome.progress[:3] == [0, 1, 2]
    assert run.done() and run.ctx.cancel_requested


async def test_a_task_that_finishes_before_the_cancel_reaches_it_succeeds() -> None:
    @task
    async def quick(ctx: JobContext, payload: Any) -> str:
        ctx.progress("last")
        return "finished first"  # no await after the report: the cancel comes too late

    outcome = await run_task(quick, None, cancel_after_progress=1)
    assert (outcome.state, outcome.result) == ("succeeded", "finished first")


async def test_cancelled_raised_with_no_cancel_requested_is_a_failure() -> None:
    @task(retries=3)
    async def confused(ctx: JobContext, payload: Any) -> None:
        raise Cancelled("nobody asked")

    outcome = await run_task(confused, None)
    assert outcome.state == "failed" and outcome.error is not None
    assert (outcome.error.type, outcome.error.retryable) == ("Cancelled", False)


async def test_a_task_raising_cancelled_error_itself_fails_its_attempt() -> None:
    """Not a stop: given back to its queue it would fail so again at once, forever, never
    counting an attempt (a worker looped on such a job 25,000 times in 8 s)."""

    @task(retries=1)
    async def leaks(ctx: JobContext, payload: Any) -> None:
        inner = asyncio.ensure_future(asyncio.sleep(10))
        inner.cancel()
        await inner  # the inner task's cancellation escapes

    first = await run_task(leaks, None)
    assert first.state == "retry" and first.error is not None
    assert (first.error.type, first.error.retryable) == ("CancelledError", True)
    last = await run_task(leaks, None, attempt=2)
    assert last.state == "failed"


@pytest.mark.parametrize(
    "raised", [SystemExit(3), KeyboardInterrupt(), GeneratorExit(), BaseException("odd")]
)
async def test_what_is_no_exception_fails_the_attempt_not_the_worker(
    raised: BaseException,
) -> None:
    @task(retries=0)
    async def exits(ctx: JobContext, payload: Any) -> None:
        raise raised

    @task(retries=0)
    def exits_in_a_thread(ctx: JobContext, payload: Any) -> None:
        raise raised

    for t in (exits, exits_in_a_thread):
        outcome = await run_task(t, None)
        assert outcome.state == "failed" and outcome.error is not None, (t, outcome)
        assert outcome.error.type == type(raised).__name__


def _nested(depth: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(depth):
        out = [out]
    return out


async def test_an_attempt_closed_while_another_task_runs_ends_quietly() -> None:
    """Its coroutine closed from outside (as the garbage collector closes one destroyed
    unfinished): the GeneratorExit thrown in is not taken for one the task raised. The
    attempt reports nothing and lets the close happen ("coroutine ignored GeneratorExit"
    before, and a failure reported for a job that was still running)."""
    started = asyncio.Event()

    @task
    async def waits(ctx: JobContext, payload: Any) -> None:
        started.set()
        await asyncio.Event().wait()

    run = start_task(waits, None)
    await started.wait()
    run._handle.get_coro().close()  # from this task, not the attempt's
    assert run._ended is None
    # (its task, whose coroutine is gone, can only fail when stepped again: retrieved here)
    run._handle.cancel()
    await asyncio.wait({run._handle})
    assert isinstance(run._handle.exception(), RuntimeError)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no words")


@pytest.mark.parametrize(
    ("returned", "raised", "why"),
    [
        # a result nested deeper than the encoder goes: a RecursionError, not a TypeError
        (_nested(5000), None, "RecursionError"),
        # a file name os.listdir decoded with surrogateescape: not UTF-8
        ({"file": b"caf\xe9.txt".decode("utf-8", "surrogateescape")}, None, "UnicodeEncodeError"),
        (None, FileNotFoundError(b"no caf\xe9".decode("utf-8", "surrogateescape")), "\\udce9"),
        (None, _Unprintable(), "its __str__ raised"),
    ],
)
async def test_an_outcome_that_cannot_be_put_in_json_as_it_is_still_ends_the_attempt(
    returned: Any, raised: BaseException | None, why: str
) -> None:
    """Each of these left its job running for good on a worker (no outcome was reported)."""

    @task(retries=0)
    async def odd(ctx: JobContext, payload: Any) -> Any:
        if raised is not None:
            raise raised
        return returned

    outcome = await run_task(odd, None)
    assert outcome.state == "failed" and outcome.error is not None, outcome
    assert why in outcome.error.message, outcome.error.message
    msgspec.json.encode(outcome.error.message)  # and it is printable as JSON


async def test_a_sync_task_past_its_timeout_is_asked_to_stop() -> None:
    """Its thread cannot be interrupted: the attempt ends at the timeout, and the task sees
    ``ctx.cancel_requested`` (it never did, and ran on beside the next attempt)."""
    saw = threading.Event()

    @task(timeout=0.2, retries=0)
    def slow(ctx: JobContext, payload: Any) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if ctx.cancel_requested:
                saw.set()
                return
            time.sleep(0.01)

    outcome = await run_task(slow, None)
    assert outcome.state == "failed" and outcome.error is not None
    assert outcome.error.type == "TimeoutError"
    assert await asyncio.to_thread(saw.wait, 60)


async def test_progress_that_cannot_be_json_is_a_type_error_as_documented() -> None:
    """ctx.progress and ctx.checkpoint raise TypeError for what cannot be JSON, whatever the
    encoder raised (a lone surrogate, a value nested too deep), naming it."""

    def named(exc: TypeError) -> str:
        return next(n for n in ("UnicodeEncodeError", "RecursionError") if n in str(exc))

    @task
    async def reports(ctx: JobContext, payload: Any) -> list[str]:
        refused = []
        for value in (b"caf\xe9".decode("utf-8", "surrogateescape"), _nested(5000)):
            try:
                ctx.progress({"value": value})
            except TypeError as exc:
                refused.append(named(exc))
            try:
                await ctx.checkpoint({"value": value})
            except TypeError as exc:
                refused.append(named(exc))
        return refused

    outcome = await run_task(reports, None)
    assert outcome.state == "succeeded", outcome
    assert outcome.result == ["UnicodeEncodeError"] * 2 + ["RecursionError"] * 2


async def test_a_retry_delay_that_has_passed_retries_at_once() -> None:
    @task(retries=3)
    async def late(ctx: JobContext, payload: Any) -> None:
        raise Retry("the window reopened a moment ago", delay=-1.5)

    outcome = await run_task(late, None)
    assert outcome.state == "retry" and outcome.retry_in == 0


@pytest.mark.parametrize(
    ("make", "says"),
    [(lambda: Retry(delay="5"), "number of seconds"), (lambda: Retry(5), "Retry(delay=5)")],  # type: ignore[arg-type]
)
def test_a_retry_with_a_delay_that_is_no_number_says_so(make: Any, says: str) -> None:
    with pytest.raises(TypeError, match=re.escape(says)):
        make()


async def test_cancelling_the_caller_cancels_the_attempt_and_is_not_swallowed() -> None:
    started = asyncio.Event()
    stopped: list[bool] = []

    @task
    async def long(ctx: JobContext, payload: Any) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(True)

    caller = asyncio.ensure_future(run_task(long, None))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    async with asyncio.timeout(10):  # the attempt's own cancellation runs its finally
        while not stopped:
            await asyncio.sleep(0)
    assert stopped == [True]


async def test_cancel_after_progress_must_count_reports() -> None:
    with pytest.raises(ValueError, match="cancel_after_progress"):
        await run_task(describe, None, cancel_after_progress=0)


async def test_an_outcome_is_a_plain_value() -> None:
    outcome = await run_task(report_async, {"n": 1})
    assert isinstance(outcome, Outcome)
    assert outcome == Outcome(
        "succeeded",
        result="done",
        progress=[{"done": 0}],
        job_id=outcome.job_id,
        attempt=1,
        max_attempts=3,
    )


# --- dependencies -----------------------------------------------------------------------------
A, B, C, D = (f"01JDEPENDENCY{i}00000000000000-0" for i in range(4))


@task(retries=0)
async def fan_in(ctx: JobContext, payload: Any) -> dict[str, Any]:
    """What a dependent sees of the jobs it waited for."""
    read = {dep: await ctx.result(dep) for dep, d in ctx.dependencies.items() if d.result_url}
    return {
        "seen": {dep: [d.state, d.result, d.result_url is not None] for dep, d in ctx.dependencies.items()},
        "previous": ctx.previous,
        "last": await ctx.result(),
        "read": read,
    }  # fmt: skip


async def test_dependencies_are_results_by_id_in_order() -> None:
    outcome = await run_task(fan_in, None, dependencies={A: {"n": 1}, B: None, C: [1, (2, 3)]})
    assert outcome.state == "succeeded", outcome.error
    assert outcome.result == {
        "seen": {A: ["succeeded", {"n": 1}, False], B: ["succeeded", None, False],
                 C: ["succeeded", [1, [2, 3]], False]},  # as claimed: JSON, tuples as lists
        "previous": [1, [2, 3]], "last": [1, [2, 3]], "read": {},
    }  # fmt: skip
    assert list(outcome.result["seen"]) == [A, B, C]


async def test_other_outcomes_are_given_as_dependency_values_and_seen_whole() -> None:
    given = {
        A: Dependency(id=A, state="failed", error=JobError("Fatal", "no"), child=True),
        B: Dependency(id=B, state="cancelled", error=JobError("Cancelled", "asked")),
        C: Dependency(id=C, state="missing"),
        D: Dependency(id=D, state="succeeded", result={"ok": True}, child=True),
    }
    seen: list[dict[str, Dependency]] = []

    async def look(ctx: JobContext, payload: Any) -> Any:
        seen.append(ctx.dependencies)
        return ctx.previous

    outcome = await run_task(look, None, dependencies=given)
    assert outcome.state == "succeeded" and outcome.result == {"ok": True}
    assert seen == [given]


async def test_a_stored_result_is_read_with_ctx_result_only() -> None:
    big = {"rows": list(range(1000))}
    stored = Dependency(id=B, state="succeeded", result=big, result_url="anywhere")
    outcome = await run_task(fan_in, None, dependencies={A: 1, B: stored})
    assert outcome.state == "succeeded", outcome.error
    assert outcome.result == {
        "seen": {A: ["succeeded", 1, False], B: ["succeeded", None, True]},
        "previous": None, "last": big, "read": {B: big},
    }  # fmt: skip


async def test_without_dependencies_the_context_has_none() -> None:
    outcome = await run_task(fan_in, None)
    assert outcome.result == {"seen": {}, "previous": None, "last": None, "read": {}}


async def test_dependencies_a_worker_would_never_hand_over_are_refused() -> None:
    with pytest.raises(ValueError, match="'pending'"):
        await run_task(fan_in, None, dependencies={A: Dependency(id=A, state="pending")})
    with pytest.raises(ValueError, match="has id"):
        await run_task(fan_in, None, dependencies={A: Dependency(id=B, state="missing")})
    for bad_id in ("a b", "a\tb", "", "a\n"):
        with pytest.raises(ValueError, match="not a job id"):
            await run_task(fan_in, None, dependencies={bad_id: 1})
    with pytest.raises(ValueError, match="has no result"):
        await run_task(fan_in, None, dependencies={A: Dependency(id=A, state="failed", result=1)})
    with pytest.raises(ValueError, match="has no error"):
        error = JobError("E", "m")
        await run_task(
            fan_in, None, dependencies={A: Dependency(id=A, state="succeeded", error=error)}
        )
    with pytest.raises(InvalidRequest, match="dependencies"):
        await run_task(fan_in, None, dependencies={A: object()})
