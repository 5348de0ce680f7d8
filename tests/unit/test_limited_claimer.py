"""A limited queue's claim loop (worker/permits.py) at its seams: an acquire whose reply was
lost is sent again with its token at the next rounds, for half a lease from its first send
(a Redis that never answers, a clock the test moves); the ready counts read shard by shard
(their replies given by the test)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier.worker.permits import LimitedClaimer, LimitedQueues


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
    assert await counts_read(some, monkeypatch)._ready_by_shard() == [(1, 2)]
    # the shards it could read hold nothing: not idle (a burst worker would end), an error
    with pytest.raises(RedisConnectionError):
        await counts_read([down, [None] * 4, [None] * 4, down], monkeypatch)._ready_by_shard()
    # every shard read, none holds a job: idle
    assert await counts_read([[None] * 4] * 4, monkeypatch)._ready_by_shard() == []
