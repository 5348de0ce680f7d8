"""Whether a Redis is fit for jobtier, checked as a process starts (``Store.connect``): that it
answers (a restarting one is waited for a while, one loading its data for as long as it
loads), that it takes jobtier's credentials, that it is Redis 7 or newer, that it never
evicts, and that its writes reach an append-only file."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.asyncio import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobtier.config import Settings, masked_url
from jobtier.core.errors import ConfigError
from jobtier.runtime.backoff import STARTUP
from jobtier.store.redis import RedisClient, info_of_primaries

log = logging.getLogger("jobtier.redis")

STARTUP_PATIENCE = 30.0  # seconds a starting process waits for a Redis that does not answer
EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")
NOT_A_CLUSTER_NODE = -2  # _cluster_masters of a server that is none
# `jobtier run`'s own Redis (its --redis-port default; a unit test keeps the two in step)
RUN_REDIS_URL = "redis://127.0.0.1:16379/0"
DEFAULT_REDIS_URL = Settings.__dataclass_fields__["redis_url"].default


def refused_message(settings: Settings, exc: BaseException) -> str:
    """Redis answered, and refused jobtier's credentials."""
    return (
        f"Redis at {masked_url(settings.redis_url)} refused jobtier's credentials: {exc}. "
        "Check the user and password in JOBTIER_REDIS_URL (redis://user:password@host:port/db) "
        "and that the user exists and is on (ACL LIST on the server)."
    )


def _refused_credentials(exc: BaseException) -> bool:
    if isinstance(exc.__cause__, AuthenticationError):
        return True
    text = str(exc)
    return any(
        sign in text
        for sign in ("NOAUTH", "WRONGPASS", "invalid username-password", "already authenticated")
    )


def not_a_cluster_message(settings: Settings, exc: BaseException) -> str:
    """JOBTIER_REDIS_CLUSTER=1, and the node named did not answer as a cluster node."""
    reason = next(
        (str(e) for e in _chain(exc) if isinstance(e, ResponseError)), "it is no cluster node"
    )
    return (
        f"the Redis at {masked_url(settings.redis_url)} did not answer CLUSTER SLOTS as a "
        f"node of a Redis Cluster ({reason}), and JOBTIER_REDIS_CLUSTER=1 says it is one. For a "
        "single server, unset JOBTIER_REDIS_CLUSTER; for a cluster, name one of its nodes in "
        "JOBTIER_REDIS_URL, and let jobtier's user run CLUSTER SLOTS."
    )


def a_cluster_node_message(settings: Settings, masters: int) -> str:
    """A node of a cluster other than one master serving every slot, talked to as a single
    server (``masters``: its size, 0 when none serves slots yet, -1 when unknown)."""
    if masters > 1:
        what = f"a Redis Cluster of {masters} masters"
        why = "jobtier would send it the keys the other masters serve"
    elif masters == 0:
        what = "a Redis Cluster whose masters serve no slot yet"
        why = "it would refuse every key"
    else:
        what = "a Redis Cluster (cluster_enabled:1; its size could not be read: CLUSTER INFO)"
        why = "jobtier would send it keys that other masters may serve"
    return (
        f"the Redis at {masked_url(settings.redis_url)} is a node of {what}, and "
        f"JOBTIER_REDIS_CLUSTER is not set: {why}. Set JOBTIER_REDIS_CLUSTER=1."
    )


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, nearest first."""
    seen: list[BaseException] = []
    at: BaseException | None = exc
    while at is not None and at not in seen:
        seen.append(at)
        at = at.__cause__ or at.__context__
    return seen


def _may_pass(exc: RedisClusterException) -> bool:
    """Whether what kept a cluster client from the slots may pass: the node did not answer
    (a connection refused or lost, a time-out), or answered with slots that do not cover
    every one (no error under redis-py's own)."""
    under = [e for e in _chain(exc)[1:] if not isinstance(e, RedisClusterException)]
    transient = (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError)
    return not under or any(isinstance(e, transient) for e in under)


def _reason(exc: BaseException) -> str:
    """The class and the words of an error (redis-py's own repr gives only a category and
    the class)."""
    return f"{type(exc).__name__}: {exc}"


def cluster_not_ok_message(settings: Settings, exc: BaseException) -> str:
    """The cluster answers, but some master says it is not whole."""
    return (
        f"the Redis Cluster at {masked_url(settings.redis_url)} is not ok: {exc}. Its nodes "
        "do not all serve every slot, or cannot see most masters (CLUSTER INFO and CLUSTER "
        "NODES on them say which); jobtier starts once cluster_state is ok on every master."
    )


def _not_a_cluster(exc: RedisClusterException) -> bool:
    """redis-py's word for a node that refused CLUSTER SLOTS (no cluster mode, or an ACL)."""
    return any("Cluster mode is not enabled" in str(e) for e in _chain(exc))


def unreachable_message(settings: Settings, exc: BaseException) -> str:
    """Why we cannot talk to Redis, and where to look next."""
    reason = str(exc).rstrip(".")  # redis-py's own ends with one ("Connection refused.")
    message = f"cannot reach Redis at {masked_url(settings.redis_url)}: {reason}."
    if settings.redis_url == DEFAULT_REDIS_URL:
        return message + (
            " That is JOBTIER_REDIS_URL's default (the variable is not set): name your server "
            f"in JOBTIER_REDIS_URL; to use the Redis that `jobtier run` starts, "
            f"JOBTIER_REDIS_URL={RUN_REDIS_URL}"
        )
    return message + " Is the server running, and is JOBTIER_REDIS_URL right?"


async def check_redis(
    redis: RedisClient, settings: Settings, *, log_every: float = 5.0
) -> list[str]:
    """Refuse a Redis that can lose acknowledged jobs (an evicting memory policy, no AOF).
    Returns warnings; raises ConfigError.

    A Redis still loading its data is waited for, its progress logged every ``log_every``
    seconds; one that does not answer, or a cluster not whole, is waited for up to
    ``STARTUP_PATIENCE`` seconds (it may be restarting as this process starts; counted from
    the end of a load), then is a ConfigError.
    """
    backoff, since = STARTUP.start(), time.monotonic()
    logged = -log_every

    def loading(percent: str) -> None:
        nonlocal logged, since
        since = time.monotonic()  # it answers: the patience counts from its load's end
        if time.monotonic() - logged >= log_every:
            logged = time.monotonic()
            log.warning(
                "event=redis_loading url=%s percent=%s: Redis is loading its data after a "
                "restart; waiting for it",
                masked_url(settings.redis_url),
                percent,
            )

    while True:
        try:
            version = await _info_values(redis, "server", "redis_version")
            policies = await _info_values(redis, "memory", "maxmemory_policy")
            # loading and aof_enabled from one snapshot: aof_enabled reads 0 until a load ends,
            # so read apart, a load ending in between would look like a Redis without AOF
            persistence = await info_of_primaries(redis, "persistence")
            if any(str(node.get("loading")) == "1" for node in persistence):
                loading(",".join(str(n.get("loading_loaded_perc", "?")) for n in persistence))
                raise BusyLoadingError("Redis is loading the dataset in memory")
            aof = [str(node.get("aof_enabled", "")) for node in persistence]
            if isinstance(redis, RedisCluster):
                masters = NOT_A_CLUSTER_NODE
                # a cluster being made, or whose nodes have not all seen it whole yet,
                # answers CLUSTERDOWN to the keys of the nodes that have not
                if down := await _cluster_down(redis):
                    raise ClusterDownError(f"cluster_state is not ok on {', '.join(down)}")
            else:
                masters = await _cluster_masters(redis)
            break
        except BusyLoadingError:
            # it will serve once loaded (exiting would only restart us into the same wait)
            await asyncio.sleep(min(backoff.next(), 0.5))
        except AuthenticationError as exc:  # a ConnectionError, but waiting will not mend it
            raise ConfigError(refused_message(settings, exc)) from exc
        except (
            RedisClusterException,
            RedisConnectionError,
            RedisTimeoutError,
            OSError,
            ClusterDownError,
        ) as exc:
            if isinstance(exc, RedisClusterException):
                # a cluster client that could not learn the slots from the node it was given
                # says why in its own words, Redis's among them: a refusal of the
                # credentials, a node that is no cluster node, a node loading its data;
                # waited for: the node not answering yet, or the slots it knows not covering
                # every one (a cluster being made, a master restarting)
                if _refused_credentials(exc):
                    raise ConfigError(refused_message(settings, exc)) from exc
                if _not_a_cluster(exc):
                    raise ConfigError(not_a_cluster_message(settings, exc)) from exc
                if any(isinstance(e, BusyLoadingError) for e in _chain(exc)):
                    loading("?")  # it refuses CLUSTER SLOTS until loaded
                    await asyncio.sleep(min(backoff.next(), 0.5))
                    continue
                if not _may_pass(exc):  # a protocol error, say: no wait will mend it
                    raise ConfigError(unreachable_message(settings, exc)) from exc
            if time.monotonic() - since > STARTUP_PATIENCE:
                if isinstance(exc, ClusterDownError):
                    raise ConfigError(cluster_not_ok_message(settings, exc)) from exc
                raise ConfigError(unreachable_message(settings, exc)) from exc
            wait = backoff.next()
            log.warning(
                "event=redis_unreachable action=waiting retry_in=%.1fs error=%s",
                wait,
                _reason(exc),
            )
            await asyncio.sleep(wait)
        except RedisError as exc:
            raise ConfigError(unreachable_message(settings, exc)) from exc
    problems, warnings = [], []
    if any(int(v.split(".")[0]) < 7 for v in version):
        problems.append(f"Redis {', '.join(sorted(set(version)))} is too old: jobtier needs 7.0+")
    bad = sorted({p for p in policies if p in EVICTING})
    if bad:
        problems.append(
            f"maxmemory-policy is {bad[0]}: Redis would evict jobs under memory pressure; "
            "set it to noeviction (or a volatile-* policy)"
        )
    if any(v != "1" for v in aof):
        message = (
            "appendonly is off: a restart of Redis would lose jobs it has acknowledged; turn it "
            "on in the server's configuration (appendonly yes), or at once with "
            "`redis-cli CONFIG SET appendonly yes` plus `CONFIG REWRITE`"
        )
        if settings.redis_require_aof:
            problems.append(
                message + ". Only for a throwaway setup whose jobs may be lost: "
                "JOBTIER_REDIS_REQUIRE_AOF=0"
            )
        else:
            warnings.append(message)
    if masters == 1:
        warnings.append(
            "this Redis is the one master of a Redis Cluster, talked to as a single server: "
            "set JOBTIER_REDIS_CLUSTER=1, or jobtier will not follow the cluster once it has "
            "more masters"
        )
    elif masters != NOT_A_CLUSTER_NODE:
        problems.append(a_cluster_node_message(settings, masters))
    if problems:
        raise ConfigError("Redis is not fit for jobtier: " + "; ".join(problems))
    if await _full_coverage_required(redis):
        warnings.append(
            "cluster-require-full-coverage is yes: while one master fails over, every node "
            "refuses every key (CLUSTERDOWN), not only the lost master's slots; set it to no "
            "(`CONFIG SET cluster-require-full-coverage no` on each node, plus CONFIG REWRITE)"
        )
    return warnings


async def _full_coverage_required(redis: RedisClient) -> bool:
    """(A cluster of several masters) whether a node requires full slot coverage; False when
    CONFIG is not allowed (a managed service decides for itself)."""
    if not isinstance(redis, RedisCluster) or len(redis.get_primaries()) < 2:
        return False
    try:
        replies = await redis.config_get(
            "cluster-require-full-coverage", target_nodes=RedisCluster.PRIMARIES
        )
    except RedisError:
        return False
    values: list[Any] = []  # {node: {name: value}}
    for reply in (replies or {}).values():
        values += reply.values() if isinstance(reply, dict) else [reply]
    return any((v.decode() if isinstance(v, bytes) else str(v)) == "yes" for v in values)


async def _cluster_down(redis: RedisCluster) -> list[str]:
    """The masters whose CLUSTER INFO says the cluster is not ok (none when it may not be
    read: jobtier's user may not, say)."""
    try:
        replies: Any = await redis.cluster_info(target_nodes=RedisCluster.PRIMARIES)
    except ResponseError:
        return []
    if "cluster_state" in replies:  # one master: its reply as is, not by node name
        replies = {"the master": replies}
    return sorted(
        str(node) for node, info in replies.items() if str(info.get("cluster_state")) != "ok"
    )


async def _cluster_masters(redis: RedisClient) -> int:
    """(A client of a single server) NOT_A_CLUSTER_NODE when the server is none, else the
    masters of its cluster that serve slots (-1 when CLUSTER INFO may not be read)."""
    if str((await redis.info("cluster")).get("cluster_enabled", 0)) != "1":
        return NOT_A_CLUSTER_NODE
    try:
        info = await redis.execute_command("CLUSTER", "INFO")
    except ResponseError:  # jobtier's user may not
        return -1
    text = info.decode() if isinstance(info, bytes) else str(info)
    fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
    return int(fields.get("cluster_size", -1))


async def _info_values(redis: RedisClient, section: str, field: str) -> list[str]:
    return [str(node.get(field, "")) for node in await info_of_primaries(redis, section)]
