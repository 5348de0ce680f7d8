"""Redis clients (one server or a cluster), the start-up check, and shard-channel subscribers."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode, ClusterPipeline
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    RedisClusterException,
    RedisError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobtier.config import Settings
from jobtier.store.faults import connection_closed_under_it

log = logging.getLogger("jobtier.redis")

RedisClient = Redis | RedisCluster
T = TypeVar("T")


# CPython gh-86296, fixed in 3.12, whose asyncio.wait_for is asyncio.timeout underneath
_WAIT_FOR_LOSES_CANCELS = sys.version_info < (3, 12)


class _Fast(AbstractConnection):
    """What jobtier's connections change of redis-py's (TCP, TLS or a Unix socket alike):

    * commands packed with hiredis: the same bytes as redis-py's pure-Python packer, much
      faster on the batched script calls of the hot paths. Anything hiredis refuses (a
      command name with a space, a value of a type it does not know) goes the usual way;
    * a cancel is never lost in a write (``send_packed_command``)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        name = args[0]
        if " " not in name if isinstance(name, str) else b" " not in name:
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass
        return list(super().pack_command(*args))

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        """redis-py's, but with the write bounded by ``asyncio.timeout`` where redis-py calls
        ``asyncio.wait_for``. On Python 3.11 ``wait_for`` returns the inner call's result when
        a cancel arrives just as that call finished, and the cancel is lost (CPython gh-86296):
        a deadline around a Redis call (``asyncio.timeout``) then never fired, and a cancelled
        task went on as if nothing had happened. A plain GET lost more than half the cancels
        that came while it ran (tests/integration/test_redis_cancel.py)."""
        if not (self.socket_timeout and _WAIT_FOR_LOSES_CANCELS):  # redis-py's is sound then
            await super().send_packed_command(command, check_health)
            return
        if not self.is_connected:
            await self.connect_check_health(check_health=False)
        if check_health:
            await self.check_health()  # type: ignore[no-untyped-call]
        try:
            if isinstance(command, str):
                command = command.encode()
            if isinstance(command, bytes):
                command = [command]
            async with asyncio.timeout(self.socket_timeout):
                await self._send_packed_command(command)
        except TimeoutError:  # before OSError, of which it is a subclass
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)
            number, text = exc.args[:2] if len(exc.args) > 1 else ("UNKNOWN", exc)
            raise RedisConnectionError(f"Error {number} while writing to socket. {text}.") from exc
        except BaseException:  # a cancel mid-write: the connection's state is unknown
            await self.disconnect(nowait=True)
            raise


# inside sent_once(): the client library sends a command once, however it fails
_SEND_ONCE: contextvars.ContextVar[bool] = contextvars.ContextVar("send_once", default=False)


class _Retry(Retry):
    """redis-py's retries, but none inside ``sent_once()``: the call is made once, and on a
    failure its connection is dropped (the library's failure handler) and the error raised.
    A behaviour of the call, not a field: redis-py (5.x) gives each new connection a deep
    copy of its pool's retry object, which must not keep what was read inside."""

    async def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        if not _SEND_ONCE.get():
            return await super().call_with_retry(do, fail, *args, **kwargs)
        try:
            return await do()
        except self._supported_errors as error:
            # (redis-py 6+ may ask for the failure count: its handler's second argument)
            counted = kwargs.get("with_failure_count", args[1] if len(args) > 1 else False)
            await (fail(error, 1) if counted else fail(error))
            raise


@contextlib.contextmanager
def sent_once() -> Iterator[None]:
    """Within it, this task's commands are not sent again by the client library when their
    connection fails (a command whose reply was lost may have run): the caller sees the
    connection's error and decides, as a claim does (its token makes it safe to send again,
    and an error reply to a send the library made again would hide that the first may have
    run: worker/claimer.py)."""
    token = _SEND_ONCE.set(True)
    try:
        yield
    finally:
        _SEND_ONCE.reset(token)


class FastConnection(_Fast, Connection):
    """A TCP connection, jobtier's way (``_Fast``)."""


class FastSSLConnection(_Fast, SSLConnection):
    """A TLS connection (``rediss://``), jobtier's way."""


class FastUnixConnection(_Fast, UnixDomainSocketConnection):
    """A Unix socket connection (``unix://``), jobtier's way."""


# the class redis-py picks for a URL's scheme -> ours of the same kind
FAST: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: FastConnection,
    SSLConnection: FastSSLConnection,
    UnixDomainSocketConnection: FastUnixConnection,
}


class FastSentinelConnection(SentinelManagedConnection, FastConnection):
    """A connection to whichever node the sentinels name master, packing with hiredis."""


class FastSentinelSSLConnection(SentinelManagedConnection, FastSSLConnection):
    """The same over TLS (a ``rediss://`` JOBTIER_REDIS_URL beside the sentinels)."""


class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The sentinels' master pool, waiting for a free connection past its size as the
    single-server pool does; closing the client closes its connections to the sentinels."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # the client's close (a new master only drops idle ones)
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()


# set while a command or pipeline of a Cluster runs: an aclose() then comes from redis-py's
# own error handling, not from the client's owner (see Cluster.aclose)
_IN_COMMAND: contextvars.ContextVar[bool] = contextvars.ContextVar("in_command", default=False)
REFRESH_EVERY = 0.25  # seconds: at most one topology refresh (CLUSTER SLOTS) in this time


class Cluster(RedisCluster):
    """A Redis Cluster client that routes FCALL by its keys, as redis-py routes EVALSHA,
    and rides through a master's failover.

    redis-py asks a node for the keys of FCALL (``COMMAND GETKEYS``): one more round trip
    before each call. Every jobtier function names its keys first (``numkeys``, then the
    keys, all in one slot), so the slot is worked out here.

    Failover: on CLUSTERDOWN, or a pipeline that failed on one node, redis-py closes the
    whole client (``aclose()``): every connection to every node, those other commands are
    using included. Those commands then fail on healthy nodes too (a write to a closed
    connection raises ``AttributeError: 'NoneType' object has no attribute 'writelines'``),
    and every command waits for a new topology. Here an ``aclose()`` made from inside a
    command only asks for the topology to be read again, and connections are recycled
    lazily (redis-py marks them for reconnect once they are free). A node that refuses
    connections (a killed master) makes every command sent to it ask for a refresh: they
    are made at most once per ``REFRESH_EVERY`` seconds, so the other nodes' traffic is not
    held behind a CLUSTER SLOTS per failed command."""

    _refreshed_at = -REFRESH_EVERY  # monotonic time of the last topology refresh

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # redis-py makes its nodes' connections of its own class whatever it is given
        # (connection_class is dropped): the nodes it knows and those it finds get ours
        options = self.nodes_manager.connection_kwargs
        ours = FAST.get(options["connection_class"], options["connection_class"])
        options["connection_class"] = ours
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = ours

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        token = _IN_COMMAND.set(True)
        try:
            return await super().execute_command(*args, **kwargs)
        except (AttributeError, RuntimeError) as exc:
            if connection_closed_under_it(exc):  # a node's connections reset under the call
                self._initialize = True
                raise RedisConnectionError(f"connection closed under the call: {exc}") from exc
            raise
        finally:
            _IN_COMMAND.reset(token)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return ClusterPipe(self, transaction)  # type: ignore[abstract]

    async def aclose(self) -> None:
        if _IN_COMMAND.get():
            # redis-py's reaction to CLUSTERDOWN or a failed pipeline: re-read the topology
            # at the next command, closing nothing other commands are using
            self._initialize = True
            return
        known = self.nodes_manager.default_node is not None
        await super().aclose()
        if not known:
            # redis-py closes nothing of a client whose first topology read failed (a node
            # that is no cluster node, a cluster not up yet): the startup nodes it asked
            # keep their connections
            await self.nodes_manager.aclose("startup_nodes")

    async def initialize(
        self,
        additional_startup_nodes_info: list[tuple[str, int]] | None = None,
        last_failed_node_name: str | None = None,
    ) -> Cluster:
        """Read the topology (CLUSTER SLOTS) when asked to, at most once per REFRESH_EVERY.

        A failure closes nothing (redis-py's closes every node's connections). Once a map is
        known, a refresh that fails leaves it in use: the command goes by it, and the next
        refresh is tried REFRESH_EVERY later. Only the first read raises. The command table
        (COMMAND) is read once, with the first map: redis-py reads it again on every refresh,
        from the first master listed, which during a failover may be the killed one (every
        refresh then failed, and with it commands bound for the healthy masters)."""
        if not self._initialize:
            return self
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._initialize:
                return self
            known = self.nodes_manager.default_node is not None and bool(
                self.commands_parser.commands
            )
            if known and time.monotonic() - self._refreshed_at < REFRESH_EVERY:
                self._initialize = False  # read just now: the command goes by it
                return self
            try:
                await self.nodes_manager.initialize(
                    additional_startup_nodes_info=additional_startup_nodes_info,
                    last_failed_node_name=last_failed_node_name,
                )
                if not self.commands_parser.commands:
                    await self.commands_parser.initialize(self.nodes_manager.default_node)
            except (RedisError, RedisClusterException, OSError) as exc:
                # RedisClusterException is no RedisError: redis-py raises it when no startup
                # node answered CLUSTER SLOTS, or their answers did not cover every slot
                if not known:
                    raise
                self._refreshed_at = time.monotonic()
                log.warning("event=redis_topology_unchanged error=%r", exc)
                return self
            self.commands_parser.node = self._live_primary(last_failed_node_name)
            self._refreshed_at = time.monotonic()
            self._initialize = False
            if known:
                log.info("event=redis_topology_refreshed nodes=%d", len(self.get_primaries()))
        return self

    def _live_primary(self, failed: str | None) -> Any:
        """The node asked for a command's keys (COMMAND GETKEYS, for the few commands whose
        keys redis-py cannot find by itself): a master other than the one that just failed."""
        primaries = self.get_primaries()
        for node in primaries:
            if node.name != failed:
                return node
        return self.nodes_manager.default_node

    async def _determine_slot(self, command: str, *args: Any) -> int:
        name = command.upper() if isinstance(command, str) else ""
        keys: Sequence[Any] = ()
        if name in ("FCALL", "FCALL_RO"):
            # FCALL <function> <numkeys> <key>...
            numkeys = int(args[1]) if len(args) > 1 else 0
            keys = args[2 : 2 + numkeys]
        elif name in ("XREAD", "XREADGROUP"):
            # ... STREAMS <key>... <id>...: keys redis-py asks a node for (COMMAND GETKEYS),
            # one more round trip each, and a failed call while that node is the killed
            # master, whichever node the stream lives on
            keys = _stream_keys(name, args)
        slots = {self.keyslot(k) for k in keys}
        if len(slots) == 1:
            return slots.pop()
        return await super()._determine_slot(command, *args)


def _stream_keys(name: str, args: Sequence[Any]) -> Sequence[Any]:
    """The keys of XREAD / XREADGROUP's arguments (after the command's name): the first half
    of what follows STREAMS, past the options (and XREADGROUP's GROUP group consumer);
    none when the arguments are not read so (redis-py then asks a node, as before)."""
    i = 3 if name == "XREADGROUP" else 0
    while i < len(args):
        word = args[i].decode() if isinstance(args[i], bytes) else args[i]
        word = word.upper() if isinstance(word, str) else ""
        if word in ("COUNT", "BLOCK"):
            i += 2
        elif word == "NOACK":
            i += 1
        elif word == "STREAMS":
            rest = args[i + 1 :]
            return rest[: len(rest) // 2]
        else:
            return ()
    return ()


class ClusterPipe(ClusterPipeline):
    """A Cluster's pipeline: its retries' ``aclose()`` is the client's soft one."""

    __slots__ = ()

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        token = _IN_COMMAND.set(True)
        try:
            return await super().execute(raise_on_error, allow_redirections)
        finally:
            _IN_COMMAND.reset(token)

    async def execute_once(self) -> list[Any]:
        """``execute(raise_on_error=False)`` without redis-py's retries of a node that failed
        (each sleeps 0.25 s and re-reads the topology): a batch of one node's calls fails
        soon when its node is down, and the caller decides (a 503, a back-off). A refused
        connection is tried once more at once (a pooled connection a restart left dead);
        redirections (MOVED, ASK) are followed as usual."""
        token = _IN_COMMAND.set(True)
        strategy: Any = self._execution_strategy
        client = self.cluster_client
        try:
            if not strategy._command_queue:
                return []
            for attempt in (1, 2):
                if client._initialize:
                    await client.initialize()
                try:
                    replies: list[Any] = await strategy._execute(
                        client, strategy._command_queue, raise_on_error=False
                    )
                    return replies
                except (AttributeError, RuntimeError) as exc:
                    # a connection the client closed under this pipeline (a topology
                    # refresh after a node failed): a connection lost to the callers
                    if not connection_closed_under_it(exc):
                        raise
                    client._initialize = True
                    if attempt == 2:
                        raise RedisConnectionError(
                            f"connection closed under the call: {exc}"
                        ) from exc
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    client._initialize = True  # re-read (at most every REFRESH_EVERY)
                    if attempt == 2 or isinstance(exc, RedisTimeoutError):
                        raise
            raise AssertionError("unreachable")
        finally:
            _IN_COMMAND.reset(token)
            await self.reset()  # type: ignore[no-untyped-call]


def first_key(command: Sequence[Any]) -> Any:
    """The key a plain command is routed by: its first argument."""
    return command[1]


async def commands_each(
    redis: RedisClient,
    commands: Sequence[Sequence[Any]],
    key: Callable[[Sequence[Any]], Any] = first_key,
) -> list[Any]:
    """The commands' replies in order, an exception in place of a failed command's: one
    pipeline; on a cluster one per node, side by side, each sent once (no retry sleeps in
    the client), so that a node that is down (a master failing over) fails only its own
    commands, at once, and the others' replies come back. A pipeline that failed whole gives
    its error to each of its commands. ``key(command)``: the key it is routed by (None: any
    node), asked on a cluster only. Inside ``sent_once`` a single server's pipeline too is
    sent once, its connection's failure its commands' reply."""
    if not isinstance(redis, RedisCluster):
        return await _pipeline_each(redis, commands)
    groups = by_node(redis, [key(command) for command in commands])
    parts = await asyncio.gather(
        *(_pipeline_each(redis, [commands[i] for i in at]) for _, at in groups)
    )
    results: list[Any] = [None] * len(commands)
    for (_, at), replies in zip(groups, parts, strict=True):
        for i, reply in zip(at, replies, strict=True):
            results[i] = reply
    return results


async def _pipeline_each(redis: RedisClient, commands: Sequence[Sequence[Any]]) -> list[Any]:
    pipe = redis.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    try:
        if isinstance(pipe, ClusterPipe):  # one cluster node's commands: no retry sleeps
            return await pipe.execute_once()
        return list(await pipe.execute(raise_on_error=False))
    except (RedisError, RedisClusterException) as exc:
        return [exc] * len(commands)


def by_node(redis: RedisCluster, keys: Sequence[Any]) -> list[tuple[ClusterNode | None, list[int]]]:
    """The indexes of ``keys`` grouped by the node that serves their slot, as the client
    knows it now (a command that moved is redirected by the pipeline as usual); None: no
    key, or none the client can place."""
    groups: dict[str, tuple[ClusterNode | None, list[int]]] = {}
    for i, key in enumerate(keys):
        node: ClusterNode | None = None
        if key is not None:
            with contextlib.suppress(RedisError, RedisClusterException, IndexError, KeyError):
                node = redis.nodes_manager.get_node_from_slot(redis.keyslot(key))
        groups.setdefault(node.name if node else "", (node, []))[1].append(i)
    return list(groups.values())


def connect(settings: Settings, **kwargs: Any) -> RedisClient:
    """A client for ``settings.redis_url``; bytes in, bytes out (no decoding on hot paths)."""
    # Retry on connection errors: after a Redis restart every pooled connection is dead. A
    # command that reached Redis and lost only its reply is sent again: a worker's transition
    # is then refused as stale, and a submit without an idempotency key may make a second job.
    # a reply overdue past the socket timeout fails the command (a master gone silent, not
    # closed: host down, network cut) instead of hanging it and every pipeline behind it.
    # The blocking commands jobtier sends wait less: XREADGROUP BLOCK (streams/consumer.py),
    # WAIT (JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS, checked in config.py); the subscribers'
    # connections have none (ShardSubscriber: a PING of their own)
    options: dict[str, Any] = {
        "decode_responses": False,
        "health_check_interval": 0,
        "socket_timeout": settings.redis_socket_timeout,
        "retry": _Retry(ExponentialBackoff(cap=1.0, base=0.05), 4),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    options.update(kwargs)
    if settings.redis_cluster:
        options.pop("health_check_interval", None)
        options.setdefault("max_connections", settings.redis_max_connections)
        return Cluster.from_url(settings.redis_url, **options)
    if settings.redis_sentinels:
        return _sentinel_master(settings, options)
    # a burst of concurrent calls waits for a free connection instead of failing with
    # "Too many connections" (the default pool raises past its size)
    # (from_url would take the URL's class over ours: its TLS or Unix socket kind is kept)
    url = parse_url(settings.redis_url)
    url["connection_class"] = FAST[url.get("connection_class", Connection)]
    # the URL's query options win, as from_url's do (?max_connections=, ?timeout=, ...)
    pool = BlockingConnectionPool(
        **{"max_connections": settings.redis_max_connections, "timeout": 30, **options, **url}
    )
    return Redis.from_pool(pool)


def _sentinel_master(settings: Settings, options: dict[str, Any]) -> Redis:
    """A client of the master the sentinels name (JOBTIER_REDIS_SENTINELS): after a failover
    its connections find the promoted replica (a connection to a demoted master is refused
    with READONLY, dropped, and made again to the new one). The URL gives the database, user
    and password; its host is not used. A ``rediss://`` URL speaks TLS to the master and to
    the sentinels alike, with the URL's ``ssl_*`` options (``?ssl_ca_certs=/path/ca.crt``)."""
    url = parse_url(settings.redis_url)
    auth = {k: url[k] for k in ("username", "password") if url.get(k)}
    tls = url.get("connection_class") is SSLConnection
    ssl: dict[str, Any] = {k: v for k, v in url.items() if k.startswith("ssl_")} if tls else {}
    sentinels = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
        settings.sentinel_addresses(),
        sentinel_kwargs={
            "socket_timeout": 2.0,
            "socket_connect_timeout": 2.0,
            **({"ssl": True, **ssl} if tls else {}),
        },
    )
    pool = BlockingSentinelPool(  # type: ignore[no-untyped-call]
        settings.redis_sentinel_master,
        sentinels,
        max_connections=settings.redis_max_connections,
        timeout=30,
        connection_class=FastSentinelSSLConnection if tls else FastSentinelConnection,
        db=url.get("db", 0),
        **auth,
        **ssl,
        **options,
    )
    return Redis.from_pool(pool)


async def master_address(redis: RedisClient) -> tuple[str, int]:
    """(Not a cluster) the address of the server ``redis`` sends its commands to: for a
    client of the sentinels, the master they name now; for a Unix socket, its path (port 0)."""
    pool = redis.connection_pool  # type: ignore[union-attr]
    if isinstance(pool, SentinelConnectionPool):
        host, port = await pool.get_master_address()  # type: ignore[no-untyped-call]
        return str(host), int(port)
    kw = pool.connection_kwargs
    if "path" in kw:
        return str(kw["path"]), 0
    return str(kw.get("host", "localhost")), int(kw.get("port", 6379))


async def info_of_primaries(redis: RedisClient, section: str) -> list[dict[str, Any]]:
    """One INFO section of every primary, one dict per node."""
    if isinstance(redis, RedisCluster):  # {node name: {field: value}}
        per_node = await redis.info(section, target_nodes=RedisCluster.PRIMARIES)
        if len(redis.get_primaries()) == 1:
            return [per_node]  # redis-py answers one node's INFO as is, not by node name
        return list(per_node.values())
    return [await redis.info(section)]


async def read_live(
    redis: RedisClient,
    key: str,
    seen: Callable[[Any], tuple[T, float]],
    fresh: float,
    forget: float,
) -> list[T]:
    """The entries of the hash ``key`` written at most ``fresh`` seconds ago; ``seen`` decodes
    one into (value, when it was written), raising ValueError for one it cannot read. Those
    unreadable, or older than ``forget`` seconds (their writer is gone), are deleted."""
    now = time.time()
    live, gone = [], []
    for field, raw in (await redis.hgetall(key)).items():
        try:
            value, at = seen(raw)
        except (ValueError, TypeError, AttributeError):
            gone.append(field)
            continue
        if now - at <= fresh:
            live.append(value)
        elif now - at > forget:
            gone.append(field)
    if gone:
        await redis.hdel(key, *gone)
    return live
