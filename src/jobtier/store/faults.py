"""What a Redis error says: Redis failing over (a 503 to retry, a fault that passes), a
connection closed under a call, or Redis refusing a command for a cause of its own. The HTTP
layer answers by it (``api/problems.py``), the long-running loops name their log lines by it.
"""

from __future__ import annotations

from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterError,
    MovedError,
    NoPermissionError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.sentinel import MasterNotFoundError

# what Redis answers while a master fails over: the cluster down or its slots moving
# (CLUSTERDOWN, TRYAGAIN, MOVED/ASK past redis-py's redirections, ClusterError "TTL
# exhausted"), a demoted master (READONLY), no master known yet (sentinels), a slot no node
# serves yet
FAILOVER: tuple[type[BaseException], ...] = (
    ClusterError,  # ClusterDownError, MasterDownError, "TTL exhausted"
    TryAgainError,
    MovedError,
    AskError,
    ReadOnlyError,
    MasterNotFoundError,
    SlotNotCoveredError,
)
# a RedisClusterException is a failover only when it says the topology could not be read or
# had no node for a call; any other (keys in two slots, arguments redis-py cannot route) is a
# defect of ours, a 500
CLUSTER_TOPOLOGY = (
    "Redis Cluster cannot be connected",
    "All slots are not covered",
    "startup_nodes could not agree",
    "No targets were found",
)
# the same, said in a reply's first word (a ResponseError that redis-py does not classify)
FAILOVER_REPLIES = ("CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK", "READONLY", "MASTERDOWN", "LOADING")


def failing_over(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis failing over, or a connection to one cluster node failing
    (its master killed, until its replica is promoted): a 503 to retry, not a defect."""
    if isinstance(exc, FAILOVER) or connection_closed_under_it(exc):
        return True
    if isinstance(exc, RedisClusterException) and str(exc).startswith(CLUSTER_TOPOLOGY):
        return True
    if isinstance(exc, ResponseError) and str(exc).split(" ", 1)[0] in FAILOVER_REPLIES:
        return True
    return isinstance(exc, RedisConnectionError) and bool(
        getattr(exc, "last_failed_node_name", None)
    )


def connection_closed_under_it(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py writing to or reading from a connection another task closed
    meanwhile (the cluster client resets a failed node's connections): an AttributeError
    (``'NoneType' object has no attribute 'writelines'``) or uvloop's RuntimeError (``the
    handler is closed``), raised from the client library's code. A connection lost, as far
    as the caller goes."""
    if isinstance(exc, AttributeError):
        if "'NoneType'" not in str(exc):
            return False
    elif not (isinstance(exc, RuntimeError) and "closed" in str(exc)):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if "/redis/" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def fault_event(exc: BaseException) -> str:
    """How a long-running loop's log line names a Redis fault: ``redis_refused`` when Redis,
    up, answered with an error of its own that will not pass by itself (out of memory under
    noeviction, MISCONF: its disk failing its snapshots, a key of a wrong type, credentials or
    permissions refused), for an operator to look at; ``redis_unavailable`` when it is away,
    loading or failing over, or restarted without a stream's consumer group (NOGROUP: the
    loop makes it again)."""
    if isinstance(exc, AuthenticationError | AuthorizationError | NoPermissionError):
        return "redis_refused"
    if isinstance(exc, ResponseError) and not failing_over(exc) and not _regrouped(exc):
        return "redis_refused"
    return "redis_unavailable"


def _regrouped(exc: ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")
