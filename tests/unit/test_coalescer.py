"""Coalescer: one batch per tick, joins in-flight keys (the read path's singleflight), and its
failure semantics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobtier.status.coalescer import Coalescer
from jobtier.status.singleflight import LoadCancelled
from tests.unit.loops import Boom, LoopErrors, gather, spin


@pytest.fixture
async def loop_errors() -> LoopErrors:
    return LoopErrors(asyncio.get_running_loop())


class Batches:
    """A fake ``load_many``: records each call; the test completes them one by one."""

    def __init__(self, *, hold: bool = True) -> None:
        self.hold = hold
        self.calls: list[list[str]] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.cancelled = 0

    async def __call__(self, keys: list[str]) -> dict[str, str]:
        self.calls.append(list(keys))
        if not self.hold:
            return {k: k.upper() for k in keys if not k.startswith("missing")}
        future = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        try:
            outcome = await future
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if isinstance(outcome, BaseException):
            raise outcome
        return {k: k.upper() for k in keys}

    def release(self, index: int = -1, outcome: Any = True) -> None:
        self.futures[index].set_result(outcome)


async def test_distinct_keys_of_one_tick_go_in_one_batch(loop_errors: LoopErrors) -> None:
    load = Batches(hold=False)
    co: Coalescer[str, str] = Coalescer(load)
    keys = ["a", "b", "c", "missing-1", "a", "b"]
    results = await gather(*(co.get(k) for k in keys))
    assert results == ["A", "B", "C", None, "A", "B"]
    assert load.calls == [["a", "b", "c", "missing-1"]]
    assert (co.requests, co.joined, co.batches, co.keys_loaded) == (6, 2, 1, 4)
    assert co.max_batch_size == 4 and co.avg_batch_size == 4.0 and co.coalescing_factor == 6.0
    assert len(co) == 0
    loop_errors.check()


async def test_separate_ticks_make_separate_batches() -> None:
    load = Batches(hold=False)
    co: Coalescer[str, str] = Coalescer(load)
    assert await co.get("a") == "A"
    assert await co.get("a") == "A"  # completed: loaded again, nothing is cached here
    assert load.calls == [["a"], ["a"]]


async def test_key_loading_in_an_earlier_batch_is_joined(loop_errors: LoopErrors) -> None:
    load = Batches()
    co: Coalescer[str, str] = Coalescer(load)
    first = [asyncio.create_task(co.get(k)) for k in ("a", "b")]
    await spin()
    assert load.calls == [["a", "b"]]
    second = [asyncio.create_task(co.get(k)) for k in ("b", "c")]
    await spin()
    assert load.calls == [["a", "b"], ["c"]]  # b joined the loading batch
    load.release(0)
    load.release(1)
    assert await gather(*first, *second) == ["A", "B", "B", "C"]
    assert len(co) == 0
    loop_errors.check()


async def test_big_ticks_are_split_at_max_batch() -> None:
    load = Batches(hold=False)
    co: Coalescer[str, str] = Coalescer(load, max_batch=500)
    keys = [f"k{i}" for i in range(1201)]
    results = await gather(*(co.get(k) for k in keys))
    assert results == [k.upper() for k in keys]
    assert [len(c) for c in load.calls] == [500, 500, 201]
    assert [k for call in load.calls for k in call] == keys
    assert co.max_batch_size == 500


async def test_waiter_cancellation_does_not_cancel_the_batch(loop_errors: LoopErrors) -> None:
    load = Batches()
    co: Coalescer[str, str] = Coalescer(load)
    leader = asyncio.create_task(co.get("a"))
    others = [asyncio.create_task(co.get(k)) for k in ("a", "b")]
    await spin()
    leader.cancel()
    await spin()
    assert leader.cancelled() and load.cancelled == 0
    load.release()
    assert await gather(*others) == ["A", "B"]
    loop_errors.check()


async def test_all_waiters_cancelled_nothing_leaks(loop_errors: LoopErrors) -> None:
    load = Batches()
    co: Coalescer[str, str] = Coalescer(load)
    tasks = [asyncio.create_task(co.get(k)) for k in ("a", "b", "a")]
    await spin()
    for task in tasks:
        task.cancel()
    await gather(*tasks)
    assert len(co) == 2 and load.cancelled == 0
    load.release(outcome=Boom())  # a failure nobody waits for is not "never retrieved"
    await spin()
    assert len(co) == 0
    del tasks
    loop_errors.check()


async def test_all_waiters_cancelled_before_the_flush(loop_errors: LoopErrors) -> None:
    load = Batches(hold=False)
    co: Coalescer[str, str] = Coalescer(load)
    task = asyncio.create_task(co.get("a"))
    await asyncio.sleep(0)  # get() ran and scheduled the flush
    task.cancel()
    await gather(task)
    await spin()
    assert load.calls == [["a"]] and len(co) == 0
    loop_errors.check()


async def test_batch_error_reaches_each_waiter_once_and_is_not_cached(
    loop_errors: LoopErrors,
) -> None:
    load = Batches()
    co: Coalescer[str, str] = Coalescer(load)
    tasks = [asyncio.create_task(co.get(k)) for k in ("a", "b", "a")]
    await spin()
    error = Boom("redis down")
    load.release(outcome=error)
    assert await gather(*tasks) == [error, error, error]
    assert len(co) == 0
    again = asyncio.create_task(co.get("a"))
    await spin()
    load.release()
    assert await gather(again) == ["A"]
    assert load.calls == [["a", "b"], ["a"]]
    loop_errors.check()


async def test_waiter_cancelled_in_the_tick_its_batch_failed(loop_errors: LoopErrors) -> None:
    """The waiter is woken (the error is settled) and cancelled before it runs again."""
    load = Batches()
    co: Coalescer[str, str] = Coalescer(load)
    task = asyncio.create_task(co.get("k"))
    await spin()
    load.release(outcome=Boom())
    await asyncio.sleep(0)  # the batch task settles; the waiter's wake-up is queued
    task.cancel()
    [outcome] = await gather(task)
    assert task.cancelled() or isinstance(outcome, Boom)
    del task
    loop_errors.check()


async def test_hung_batch_times_out(loop_errors: LoopErrors) -> None:
    load = Batches()
    co: Coalescer[str, str] = Coalescer(load, timeout=0.05)
    results = await gather(*(co.get(k) for k in ("a", "b", "a")))
    assert all(isinstance(r, TimeoutError) for r in results)
    assert load.cancelled == 1 and len(co) == 0
    loop_errors.check()


async def test_batch_cancelled_from_outside_tells_the_waiters(loop_errors: LoopErrors) -> None:
    load = Batches()
    co: Coalescer[str, str] = Coalescer(load)
    waiter = asyncio.create_task(co.get("a"))
    await spin()
    for task in list(co._tasks):
        task.cancel()
    [outcome] = await gather(waiter)
    assert isinstance(outcome, LoadCancelled) and len(co) == 0
    loop_errors.check()


async def test_ten_thousand_readers_one_load(loop_errors: LoopErrors) -> None:
    load = Batches(hold=False)
    co: Coalescer[str, str] = Coalescer(load)
    results = await gather(*(co.get("hot") for _ in range(10_000)))
    assert results == ["HOT"] * 10_000
    assert load.calls == [["hot"]]
    assert co.coalescing_factor == 10_000
    loop_errors.check()


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Coalescer(Batches(), max_batch=0)


# --- random interleavings --------------------------------------------------------------

KEYS = ("a", "b", "c", "d")
ops = st.lists(
    st.one_of(
        st.tuples(st.just("get"), st.sampled_from(KEYS)),
        st.tuples(st.just("cancel"), st.integers(0, 40)),
        st.tuples(st.just("finish"), st.integers(0, 10), st.booleans()),
        st.tuples(st.just("spin"), st.integers(1, 3)),
    ),
    max_size=40,
)


class Scenario:
    """Drives a Coalescer through a list of operations; time is the operation counter."""

    def __init__(self, max_batch: int) -> None:
        self.co: Coalescer[str, tuple[str, int]] = Coalescer(self.load_many, max_batch=max_batch)
        self.max_batch = max_batch
        self.now = 0
        self.batches: list[dict[str, Any]] = []  # keys, started, ended, future
        self.loading: set[str] = set()
        self.waiters: list[tuple[str, int, asyncio.Task[tuple[str, int] | None]]] = []

    async def load_many(self, keys: list[str]) -> dict[str, tuple[str, int]]:
        assert len(keys) == len(set(keys)) <= self.max_batch
        assert not self.loading & set(keys), "a key in two batches at once"
        number = len(self.batches)
        record: dict[str, Any] = {
            "keys": keys,
            "started": self.now,
            "ended": None,
            "future": asyncio.get_running_loop().create_future(),
        }
        self.batches.append(record)
        self.loading |= set(keys)
        try:
            ok = await record["future"]
        finally:
            record["ended"] = self.now
            self.loading -= set(keys)
        if not ok:
            raise Boom(number)
        return {k: (k, number) for k in keys}

    def open_batches(self) -> list[dict[str, Any]]:
        return [b for b in self.batches if not b["future"].done()]

    async def run(self, steps: list[tuple[Any, ...]]) -> None:
        for step in steps:
            self.now += 1
            if step[0] == "get":
                task = asyncio.create_task(self.co.get(step[1]))
                self.waiters.append((step[1], self.now, task))
            elif step[0] == "cancel" and self.waiters:
                self.waiters[step[1] % len(self.waiters)][2].cancel()
            elif step[0] == "finish" and self.open_batches():
                batches = self.open_batches()
                batches[step[1] % len(batches)]["future"].set_result(step[2])
            elif step[0] == "spin":
                await spin(step[1])
        for _ in range(100):
            if all(t.done() for _, _, t in self.waiters) and not self.loading and not len(self.co):
                break
            self.now += 1
            for batch in self.open_batches():
                batch["future"].set_result(True)
            await spin()
        await spin()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=ops, max_batch=st.integers(1, 3))
def test_random_interleavings(steps: list[tuple[Any, ...]], max_batch: int) -> None:
    async def main() -> None:
        errors = LoopErrors(asyncio.get_running_loop())
        scenario = Scenario(max_batch)
        await scenario.run(steps)
        assert len(scenario.co) == 0 and scenario.co._pending == [], "entries left behind"
        assert scenario.loading == set()
        for key, asked, task in scenario.waiters:
            if task.cancelled():
                continue
            error = task.exception()
            if error is not None:
                assert isinstance(error, Boom)
                batch = scenario.batches[error.args[0]]
            else:
                result = task.result()
                assert result is not None and result[0] == key
                batch = scenario.batches[result[1]]
            # its batch held its key and was still pending or loading when it asked
            assert key in batch["keys"]
            assert batch["ended"] is not None and batch["ended"] >= asked
        assert scenario.co.keys_loaded == sum(len(b["keys"]) for b in scenario.batches)
        del scenario
        errors.check()

    asyncio.run(main())
