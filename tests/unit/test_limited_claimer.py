"""A limited queue's claim loop (worker/permits.py) at its seams: an acquire whose reply was
lost is sent again with its token at the next rounds, for half a lease from its first send
(a Redis that never answers, a clock the test moves); the ready counts read shard by shard
(their replies given by the test); the claims whose replies were lost, sent again while
their window lasts and the slots allow; the shards whose claims failed, planned last."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest
from redis.exceptions import ClusterDownError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier.worker.permits import LimitedClaimer, LimitedQueues, LostClaim, spread
from jobtier.worker.state import WorkerState


class Down:
    """Scripts whose every call fails as a dead connection does; what was sent is kept."""

    def __init__(self) -> None:
        self.sent: list[Sequence[Any]] = []

    async def call(self, script: str, shard: int, args: Sequence[Any]) -> Any:
        self.sent.append(args)
        raise RedisConnectionError("Connection closed by server.")


async def test_an_unanswered_acquire_is_sent_again_for_half_a_lease_from_its_first_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    # the module's clock only (the event loop keeps the real one)
    monkeypatch.setattr("jobtier.worker.permits.time", SimpleNamespace(monotonic=lambda: now[0]))
    scripts = Down()
    state = SimpleNamespace(
        keys=SimpleNamespace(home=lambda queue: 0), scripts=scripts, id="w", lease_ms=30_000
    )
    claimer = LimitedClaimer(cast(LimitedQueues, SimpleNamespace(state=state)), None, "q")  # type: ignore[arg-type]
    for at in (0.0, 5.0, 10.0, 14.9, 15.0, 20.0):  # seconds after the first send
        now[0] = 1000.0 + at
        with pytest.raises(RedisConnectionError):
            await claimer._acquire(2)
    tokens = [args[5] for args in scripts.sent]
    assert len(set(tokens[:4])) == 1  # sent again until half the 30 s lease has passed
    assert tokens[4] != tokens[0]  # then a new one, itself sent again
    assert tokens[5] == tokens[4]


def counts_read(replies: list[Any], monkeypatch: pytest.MonkeyPatch) -> LimitedClaimer:
    """A claim loop over len(replies) shards whose ready counts read as ``replies``."""

    async def read(redis: Any, commands: Sequence[Any]) -> list[Any]:
        assert [command[:2] for command in commands] == [
            ("HMGET", f"counts:{shard}") for shard in range(len(replies))
        ]
        return replies

    monkeypatch.setattr("jobtier.worker.permits.commands_each", read)
    keys = SimpleNamespace(
        home=lambda queue: 0, shards=len(replies), queue_counts=lambda shard: f"counts:{shard}"
    )
    state = SimpleNamespace(keys=keys, scripts=None, id="w", lease_ms=30_000, redis=None)
    return LimitedClaimer(cast(LimitedQueues, SimpleNamespace(state=state)), None, "q")  # type: ignore[arg-type]


async def test_the_ready_counts_leave_out_the_shards_whose_read_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    down = RedisConnectionError("Connection refused.")
    some = [down, [b"2", None, None, None], [None] * 4, down]
    assert await counts_read(some, monkeypatch)._ready_by_shard() == ([(1, 2)], {0, 3})
    # the shards it could read hold nothing: not idle (a burst worker would end), an error
    with pytest.raises(RedisConnectionError):
        await counts_read([down, [None] * 4, [None] * 4, down], monkeypatch)._ready_by_shard()
    # every shard read, none holds a job: idle
    assert await counts_read([[None] * 4] * 4, monkeypatch)._ready_by_shard() == ([], set())


def test_the_shards_whose_claims_failed_are_planned_last() -> None:
    ready = [(0, 5), (1, 2), (2, 1)]
    assert spread(3, ready) == [(0, 3)]  # fullest first
    assert spread(3, ready, last={0}) == [(1, 2), (2, 1)]
    assert spread(4, ready, last={0}) == [(1, 2), (2, 1), (0, 1)]  # still asked, last


class Releases:
    """Scripts that take every release; what was released is kept."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def call(self, script: str, shard: int, args: Sequence[Any]) -> Any:
        assert (script, args[:3]) == ("limit", ("release", "q", "1"))
        self.released += args[3:]
        return len(args) - 3


async def test_a_lost_claim_is_sent_again_for_half_a_lease_from_its_first_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("jobtier.worker.permits.time", SimpleNamespace(monotonic=lambda: 100.0))
    scripts = Releases()
    state = SimpleNamespace(
        keys=SimpleNamespace(home=lambda queue: 0), scripts=scripts, id="w", lease_ms=30_000
    )
    claimer = LimitedClaimer(cast(LimitedQueues, SimpleNamespace(state=state)), None, "q")  # type: ignore[arg-type]

    def lost(shard: int, until: float, permits: list[str]) -> LostClaim:
        return LostClaim(
            shard, len(permits), ("claim", shard, ()), until, ran=True, permits=permits
        )

    fresh, stale = lost(1, 101.0, ["a", "b"]), lost(2, 99.0, ["c"])
    claimer._lost = [fresh, stale]
    await claimer._drop_expired()
    assert scripts.released == ["c"] and claimer._lost == [fresh]  # its half lease passed


def test_a_claim_may_have_run_once_a_send_of_it_lost_its_reply() -> None:
    """An error reply says that send did not run; an earlier send whose connection died may
    have (a failover answers CLUSTERDOWN to the next)."""
    refused = LostClaim(0, 1, ("claim", 0, ()), 1.0)
    refused.failed(ResponseError("OOM command not allowed when used memory > 'maxmemory'."))
    assert not refused.ran
    lost = LostClaim(0, 1, ("claim", 0, ()), 1.0)
    lost.failed(RedisConnectionError("Connection closed by server."))
    lost.failed(ClusterDownError("CLUSTERDOWN The cluster is down"))
    assert lost.ran


async def test_a_reservation_that_ends_wakes_a_loop_waiting_for_a_slot() -> None:
    """A claim's reservation that ends unfilled frees its slots: a claim loop that found none
    free looks again (it used to sleep until a job ended: with none running, for good)."""
    state = SimpleNamespace(reserved=0, slot_free=asyncio.Event())
    done = WorkerState.reserve(state, 2)  # type: ignore[arg-type]
    waiting = asyncio.create_task(WorkerState.wait_for_slot(state))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # it waits now
    assert not waiting.done() and state.reserved == 2
    done()
    async with asyncio.timeout(10):
        await waiting
    assert state.reserved == 0


class Slots:
    """A worker's slots: WorkerState's own accounting, without the rest of it."""

    concurrency = 4
    keys = SimpleNamespace(home=lambda queue: 0)
    scripts = None
    running: dict[str, Any] = {}
    reserved = 0
    slot_free = asyncio.Event()
    free_slots = WorkerState.free_slots
    reserve = WorkerState.reserve


async def test_a_back_off_holds_the_slots_of_the_lost_claims_until_the_next_round() -> None:
    state = Slots()
    claimer = LimitedClaimer(cast(LimitedQueues, SimpleNamespace(state=state)), None, "q")  # type: ignore[arg-type]
    claimer._lost = [LostClaim(0, 3, ("claim", 0, ()), 1.0, ran=True, permits=["a", "b", "c"])]
    claimer._hold()
    assert state.reserved == 3 and claimer._held == 3  # the main loop sees one slot free
    claimer._hold()  # a second back-off: the same slots, not three more
    assert state.reserved == 3
    state.slot_free.clear()
    claimer._let_go()  # the round takes them over
    assert state.reserved == 0 and claimer._held == 0 and state.slot_free.is_set()
