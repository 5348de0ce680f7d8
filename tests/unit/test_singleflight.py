"""SingleFlight: shared loads, cancellation, errors, timeouts, and no leaks (fakes for loads)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobtier.cache.singleflight import LoadCancelled, SingleFlight


class Boom(Exception):
    pass


async def gather(*aws: Awaitable[Any]) -> list[Any]:
    """gather with return_exceptions, failing (not hanging) if something never settles."""
    async with asyncio.timeout(10):
        return await asyncio.gather(*aws, return_exceptions=True)


async def spin(n: int = 5) -> None:
    """Let the loop run a few iterations (tasks start, futures propagate)."""
    for _ in range(n):
        await asyncio.sleep(0)


class LoopErrors:
    """Everything reported to the loop's exception handler ("... was never retrieved")."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: self.errors.append(context))

    def check(self) -> None:
        gc.collect()  # unretrieved task/future exceptions are reported when collected
        assert self.errors == []


@pytest.fixture
async def loop_errors() -> LoopErrors:
    return LoopErrors(asyncio.get_running_loop())


class Gate:
    """A fake load whose completion the test controls."""

    def __init__(self) -> None:
        self.calls = 0
        self.cancelled = 0
        self.future: asyncio.Future[Any] | None = None

    def load(self) -> Callable[[], Awaitable[Any]]:
        async def run() -> Any:
            self.calls += 1
            self.future = asyncio.get_running_loop().create_future()
            try:
                return await self.future
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

        return run


async def test_concurrent_callers_share_one_load(loop_errors: LoopErrors) -> None:
    sf: SingleFlight[str, int] = SingleFlight()
    gate = Gate()
    tasks = [asyncio.create_task(sf.do("k", gate.load())) for _ in range(50)]
    await spin()
    assert gate.calls == 1 and "k" in sf and len(sf) == 1
    assert gate.future is not None
    gate.future.set_result(7)
    assert await gather(*tasks) == [7] * 50
    assert len(sf) == 0 and sf.loads == 1
    loop_errors.check()


async def test_next_call_after_completion_loads_again() -> None:
    sf: SingleFlight[str, int] = SingleFlight()
    calls = 0

    async def load() -> int:
        nonlocal calls
        calls += 1
        return calls

    assert await sf.do("k", load) == 1
    assert await sf.do("k", load) == 2
    assert len(sf) == 0


async def test_leader_cancelled_does_not_cancel_the_load(loop_errors: LoopErrors) -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    gate = Gate()
    leader = asyncio.create_task(sf.do("k", gate.load()))
    await spin()
    followers = [asyncio.create_task(sf.do("k", gate.load())) for _ in range(3)]
    await spin()
    leader.cancel()
    await spin()
    assert leader.cancelled() and gate.cancelled == 0
    assert gate.future is not None
    gate.future.set_result("v")
    assert await gather(*followers) == ["v"] * 3
    assert gate.calls == 1 and len(sf) == 0
    loop_errors.check()


async def test_all_waiters_cancelled_nothing_leaks(loop_errors: LoopErrors) -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    gate = Gate()
    tasks = [asyncio.create_task(sf.do("k", gate.load())) for _ in range(5)]
    await spin()
    for task in tasks:
        task.cancel()
    await gather(*tasks)
    assert all(t.cancelled() for t in tasks)
    assert gate.cancelled == 0 and len(sf) == 1  # the load carries on, unobserved
    assert gate.future is not None
    gate.future.set_exception(Boom())  # even a failure nobody waits for is not "unretrieved"
    await spin()
    assert len(sf) == 0
    del tasks
    loop_errors.check()


async def test_error_reaches_every_waiter_once_and_is_not_cached(
    loop_errors: LoopErrors,
) -> None:
    sf: SingleFlight[str, int] = SingleFlight()
    gate = Gate()
    tasks = [asyncio.create_task(sf.do("k", gate.load())) for _ in range(10)]
    await spin()
    assert gate.future is not None
    error = Boom("redis down")
    gate.future.set_exception(error)
    results = await gather(*tasks)
    assert all(r is error for r in results)
    # raised from its own traceback each time, not a chain grown by every waiter
    tb_len = 0
    tb = error.__traceback__
    while tb is not None:
        tb_len += 1
        tb = tb.tb_next
    assert tb_len < 10
    assert len(sf) == 0

    async def ok() -> int:
        return 1

    assert await sf.do("k", ok) == 1  # a new load, not the cached error
    loop_errors.check()


async def test_waiter_cancelled_in_the_tick_its_load_failed(loop_errors: LoopErrors) -> None:
    """The waiter is woken (the error is settled) and cancelled before it runs again."""
    sf: SingleFlight[str, int] = SingleFlight()
    gate = Gate()
    task = asyncio.create_task(sf.do("k", gate.load()))
    await spin()
    assert gate.future is not None
    gate.future.set_exception(Boom())
    await asyncio.sleep(0)  # the load task settles; the waiter's wake-up is queued
    task.cancel()
    [outcome] = await gather(task)
    assert task.cancelled() or isinstance(outcome, Boom)
    del task
    loop_errors.check()


async def test_hung_load_times_out_for_every_waiter(loop_errors: LoopErrors) -> None:
    sf: SingleFlight[str, int] = SingleFlight(timeout=0.05)
    gate = Gate()
    tasks = [asyncio.create_task(sf.do("k", gate.load())) for _ in range(4)]
    results = await gather(*tasks)
    assert all(isinstance(r, TimeoutError) for r in results)
    assert gate.cancelled == 1  # the load itself was cancelled
    assert len(sf) == 0
    loop_errors.check()


async def test_load_cancelled_from_outside_tells_the_waiters(loop_errors: LoopErrors) -> None:
    sf: SingleFlight[str, int] = SingleFlight()
    gate = Gate()
    waiter = asyncio.create_task(sf.do("k", gate.load()))
    await spin()
    flight = sf._flights["k"]
    assert flight.task is not None
    flight.task.cancel()  # e.g. the loop shutting down
    [outcome] = await gather(waiter)
    assert isinstance(outcome, LoadCancelled)
    assert len(sf) == 0
    loop_errors.check()


async def test_ten_thousand_readers_one_load(loop_errors: LoopErrors) -> None:
    sf: SingleFlight[str, int] = SingleFlight()
    calls = 0

    async def load() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return 42

    results = await gather(*(sf.do("hot", load) for _ in range(10_000)))
    assert calls == 1
    assert results == [42] * 10_000
    assert len(sf) == 0
    loop_errors.check()


# --- random interleavings --------------------------------------------------------------

KEYS = ("a", "b", "c")
ops = st.lists(
    st.one_of(
        st.tuples(st.just("get"), st.sampled_from(KEYS)),
        st.tuples(st.just("cancel"), st.integers(0, 40)),
        st.tuples(st.just("finish"), st.sampled_from(KEYS), st.booleans()),
        st.tuples(st.just("spin"), st.integers(1, 3)),
    ),
    max_size=40,
)


class Scenario:
    """Drives a SingleFlight through a list of operations and records what happened.

    The loads are fakes: ``finish`` completes (ok or error) the in-flight load of a key.
    Time is the operation counter.
    """

    def __init__(self) -> None:
        self.sf: SingleFlight[str, tuple[str, int]] = SingleFlight()
        self.now = 0
        self.loads: list[dict[str, Any]] = []  # key, started, ended, future
        self.in_flight: dict[str, dict[str, Any]] = {}
        self.waiters: list[tuple[str, int, asyncio.Task[tuple[str, int]]]] = []

    def loader(self, key: str) -> Callable[[], Awaitable[tuple[str, int]]]:
        async def load() -> tuple[str, int]:
            assert key not in self.in_flight, "two loads of one key at once"
            record: dict[str, Any] = {
                "key": key,
                "started": self.now,
                "ended": None,
                "future": asyncio.get_running_loop().create_future(),
            }
            number = len(self.loads)
            self.loads.append(record)
            self.in_flight[key] = record
            try:
                ok = await record["future"]
            finally:
                record["ended"] = self.now
                del self.in_flight[key]
            if not ok:
                raise Boom(number)
            return key, number

        return load

    async def run(self, steps: list[tuple[Any, ...]]) -> None:
        for step in steps:
            self.now += 1
            if step[0] == "get":
                key = step[1]
                task = asyncio.create_task(self.sf.do(key, self.loader(key)))
                self.waiters.append((key, self.now, task))
            elif step[0] == "cancel" and self.waiters:
                self.waiters[step[1] % len(self.waiters)][2].cancel()
            elif step[0] == "finish" and step[1] in self.in_flight:
                future = self.in_flight[step[1]]["future"]
                if not future.done():
                    future.set_result(step[2])
            elif step[0] == "spin":
                await spin(step[1])
        # drain: finish whatever is still loading (abandoned loads too) until all is quiet
        for _ in range(100):
            if all(task.done() for _, _, task in self.waiters) and not self.in_flight:
                break
            self.now += 1
            for record in list(self.in_flight.values()):
                if not record["future"].done():
                    record["future"].set_result(True)
            await spin()
        await spin()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=ops)
def test_random_interleavings(steps: list[tuple[Any, ...]]) -> None:
    async def main() -> None:
        errors = LoopErrors(asyncio.get_running_loop())
        scenario = Scenario()
        await scenario.run(steps)
        assert len(scenario.sf) == 0, "entries left behind"
        assert scenario.in_flight == {}
        for key, asked, task in scenario.waiters:
            if task.cancelled():
                continue
            error = task.exception()
            if error is not None:
                assert isinstance(error, Boom)
                load = scenario.loads[error.args[0]]
            else:
                got_key, number = task.result()
                assert got_key == key
                load = scenario.loads[number]
            # the load it got is one of its key that was still in flight when it asked
            assert load["key"] == key
            assert load["ended"] is not None and load["ended"] >= asked
        del scenario
        errors.check()

    asyncio.run(main())
