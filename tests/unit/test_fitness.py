"""The start-up check's reading of CLUSTER INFO and of redis-py's cluster errors (the check
against real servers and clusters: tests/integration/test_check_redis.py)."""

from __future__ import annotations

from typing import Any, cast

from redis.asyncio import RedisCluster
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    InvalidResponse,
    NoPermissionError,
    RedisClusterException,
)

from jobtier.store import fitness


class _Answers:
    """A cluster client whose CLUSTER INFO of the primaries answers ``reply`` (or raises it)."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply

    async def cluster_info(self, target_nodes: Any = None) -> Any:
        assert target_nodes == RedisCluster.PRIMARIES
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


async def _down(reply: Any) -> list[str]:
    return await fitness._cluster_down(cast(RedisCluster, _Answers(reply)))


async def test_the_masters_not_ok_are_named() -> None:
    reply = {
        "127.0.0.1:7001": {"cluster_state": "ok"},
        "127.0.0.1:7002": {"cluster_state": "fail"},
        "127.0.0.1:7000": {"cluster_state": "fail"},
    }
    assert await _down(reply) == ["127.0.0.1:7000", "127.0.0.1:7002"]
    assert await _down({k: {"cluster_state": "ok"} for k in reply}) == []


async def test_one_master_answers_as_itself() -> None:
    # redis-py gives one node's reply as is, not by node name
    assert await _down({"cluster_state": "fail", "cluster_size": 1}) == ["the master"]
    assert await _down({"cluster_state": "ok", "cluster_size": 1}) == []


async def test_a_user_who_may_not_read_it_holds_nothing_up() -> None:
    assert await _down(NoPermissionError("NOPERM no CLUSTER INFO")) == []


def _wrapped(root: BaseException | None) -> RedisClusterException:
    """As redis-py raises it: "cannot be connected" from the last node's error (or from its
    own complaint that the slots are not all covered)."""
    under = root or RedisClusterException("All slots are not covered by the startup nodes.")
    outer = RedisClusterException("Redis Cluster cannot be connected.")
    outer.__cause__ = under
    return outer


def test_what_may_pass_is_waited_for_and_what_may_not_is_not() -> None:
    assert fitness._may_pass(_wrapped(RedisConnectionError("refused")))
    assert fitness._may_pass(_wrapped(OSError("unreachable")))
    assert fitness._may_pass(_wrapped(None))  # slots not all covered yet
    assert not fitness._may_pass(_wrapped(InvalidResponse("Protocol Error: H")))
