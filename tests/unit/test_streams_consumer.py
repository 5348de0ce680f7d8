"""``Consumer.wait``'s own decisions, against a stand-in for the Redis client (the wait
itself against a real Redis: tests/integration/test_persist.py, test_webhooks.py)."""

from __future__ import annotations

import logging
from typing import Any

from jobtier.streams.consumer import Consumer


class Answers:
    """A client that answers XREADGROUP at once with ``reply`` and records the calls."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.calls: list[dict[str, Any]] = []

    async def xreadgroup(self, group: str, name: str, streams: dict[str, str], **kw: Any) -> Any:
        self.calls.append({"streams": streams, **kw})
        return self.reply


class Naps(list[float]):
    """The naps taken, in seconds."""

    async def __call__(self, seconds: float) -> bool:
        self.append(seconds)
        return False


class Counts:
    claimed = 0


def consumer(redis: Answers, cursors: list[bytes], naps: Naps) -> Consumer:
    c = Consumer(
        redis, ["s0", "s1"], "g", "m",  # type: ignore[arg-type]
        claim_idle_ms=1000, log=logging.getLogger("test"), counts=Counts(),
    )  # fmt: skip
    c._cursor = cursors
    c.sleep = naps  # type: ignore[method-assign]
    return c


async def test_it_does_not_wait_while_own_pending_entries_are_read_back() -> None:
    redis, naps = Answers([]), Naps()
    assert await consumer(redis, [b">", b"0"], naps).wait(10) is None
    assert redis.calls == [] and naps == []


async def test_it_does_not_wait_when_it_cannot_block_or_is_stopping() -> None:
    redis, naps = Answers([]), Naps()
    c = consumer(redis, [b">", b">"], naps)
    c.blocking = False  # a Redis Cluster
    assert await c.wait(10) is None
    c = consumer(redis, [b">", b">"], naps)
    c.stop()
    assert await c.wait(10) is None
    assert redis.calls == [] and naps == []


async def test_an_empty_answer_at_once_is_followed_by_a_nap_not_a_spin() -> None:
    redis, naps = Answers([]), Naps()
    c = consumer(redis, [b">", b">"], naps)
    assert await c.wait(10) == []
    assert redis.calls == [{"streams": {"s0": ">", "s1": ">"}, "count": 10, "block": 100}]
    assert len(naps) == 1 and 0.05 < naps[0] <= 0.1
    # every stream was read just now and had nothing: the next read asks Redis nothing
    assert await c.read(10) == ([], [])


async def test_entries_come_back_by_shard_whatever_the_stream_names_type() -> None:
    entries = [(b"1-0", {b"d": b"x"}), (b"1-1", {b"d": b"y"})]
    for name in (b"s1", "s1"):
        redis, naps = Answers([[name, entries]]), Naps()
        assert await consumer(redis, [b">", b">"], naps).wait(10) == [
            (1, b"1-0", {b"d": b"x"}), (1, b"1-1", {b"d": b"y"}),
        ]  # fmt: skip
        assert naps == []  # entries came: no nap


async def test_reads_ask_for_entries_by_the_transitions_the_last_read_held() -> None:
    """An entry holds one script call's transitions: a reader that wants about N transitions
    asks each stream for N over the last read's mean entry, at least one."""
    one = {b"d": b"x"}
    hundred = {b"n": b"100"}
    redis, naps = Answers([["s0", [(b"1-0", hundred), (b"1-1", hundred), (b"1-2", one)]]]), Naps()
    c = consumer(redis, [b">", b">"], naps)
    assert c.entries_for(200) == 200  # nothing read yet: an entry a transition
    await c.wait(c.entries_for(200))
    assert redis.calls[-1]["count"] == 200
    assert c.entries_for(201) == 3 and c.entries_for(10) == 1  # (100 + 100 + 1) / 3 an entry
    # entries trimmed while pending (no fields) say nothing of the size; an empty read keeps it
    redis.reply = [["s0", [(b"1-3", None)]]]
    await c.wait(5)
    assert c.entries_for(201) == 3
    redis.reply = []
    assert await c.wait(5) == []
    assert c.entries_for(201) == 3
    redis.reply = [["s0", [(b"1-4", one), (b"1-5", one)]]]
    await c.wait(5)
    assert c.entries_for(201) == 201
