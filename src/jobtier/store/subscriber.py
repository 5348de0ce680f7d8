"""Shard-channel subscribers: one bare connection per Redis node (or the master the
sentinels name), kept subscribed through restarts, failovers and slot moves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from redis.asyncio import RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.crc import key_slot
from redis.exceptions import RedisError

from jobtier.runtime.backoff import SUBSCRIBE
from jobtier.runtime.stopping import stop_task
from jobtier.store.redis import RedisClient, master_address

log = logging.getLogger("jobtier.redis")


def node_channels(redis: RedisCluster, channels: Sequence[str]) -> dict[tuple[str, int], list[str]]:
    """Group shard channels by the cluster node that serves their slot."""
    groups: dict[tuple[str, int], list[str]] = {}
    for channel in channels:
        node = redis.get_node_from_key(channel)
        if node is None:
            raise ConnectionError(f"no cluster node serves {channel}")
        groups.setdefault((str(node.host), int(node.port)), []).append(channel)
    return groups


async def node_groups(
    redis: RedisClient, channels: Sequence[str]
) -> dict[tuple[str, int], list[str]]:
    """``node_channels``, asking the sentinels for the master now (a client of theirs has
    no fixed address: after a failover the master is another server)."""
    if isinstance(redis, RedisCluster):
        return node_channels(redis, channels)
    return {await master_address(redis): list(channels)}


def _sentinel_client(redis: RedisClient) -> bool:
    return not isinstance(redis, RedisCluster) and isinstance(
        redis.connection_pool, SentinelConnectionPool
    )


class ShardSubscriber:
    """Keeps shard-channel subscriptions (SSUBSCRIBE) open and hands every message to a callback.

    One bare connection per Redis node, read in a loop, without the generic PubSub class's
    per-message bookkeeping. ``on_message(channel, data)`` runs on the event loop for each
    message and must not block. ``on_reset()`` runs after every (re)subscription: messages may
    have been missed meanwhile, so whoever relies on them must resynchronise. ``on_lost()``
    runs as soon as a subscription is found broken, before it is retried.

    A connection can die without a word (half-open TCP, a frozen server): each subscription
    sends PING every ``PING_INTERVAL`` seconds and is closed and counted lost when an answer
    is ``PONG_TIMEOUT`` seconds late. ``live`` is true while every node's subscription is
    confirmed and answering.
    """

    PING_INTERVAL = 1.0
    PONG_TIMEOUT = 3.0

    def __init__(
        self,
        redis: RedisClient,
        channels: Sequence[str],
        on_message: Callable[[bytes, bytes], None],
        on_reset: Callable[[], None] | None = None,
        name: str = "subscriber",
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.redis = redis
        self.channels = list(channels)
        self.on_message = on_message
        self.on_reset = on_reset
        self.on_lost = on_lost
        self.name = name
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._down: set[tuple[str, int]] = set()  # nodes whose subscription is not confirmed
        # since when a subscription has been lost, and the tries since: while a node is down
        # the retries go on at the back-off's first pace (a cluster's are new tasks after each
        # regroup), logged once when lost and once when every node is subscribed again
        self._lost: tuple[float, int] | None = None

    def live(self) -> bool:
        """Every node's subscription is confirmed, and none has been found broken since."""
        return bool(self._tasks) and not self._down and not self._closing

    async def start(self, timeout: float = 10.0) -> None:
        """Subscribe on every node; returns once all subscriptions are confirmed."""
        if isinstance(self.redis, RedisCluster):
            # a client that has sent no command yet does not know which node serves a slot
            await self.redis.initialize()
        # one connection of the client's kind made (not opened) here: an option of the URL its
        # class refuses fails the start with its own error, not with a timeout
        self._connection("127.0.0.1", 6379)
        async with asyncio.timeout(timeout):
            ready = await self._spawn()
            await asyncio.gather(*(r.wait() for r in ready))

    async def _spawn(self) -> list[asyncio.Event]:
        """A task per node for the channels it serves; the events set once they subscribed.
        The nodes are found now: a cluster's as the client knows its slots, the sentinels'
        master as they name it."""
        return self._start_tasks(await node_groups(self.redis, self.channels))

    def _start_tasks(self, groups: dict[tuple[str, int], list[str]]) -> list[asyncio.Event]:
        self._down = set(groups)
        ready = {node: asyncio.Event() for node in groups}
        self._tasks = [
            asyncio.create_task(self._run(node, channels, ready[node]))
            for node, channels in groups.items()
        ]
        return list(ready.values())

    async def stop(self) -> None:
        self._closing = True
        tasks, self._tasks = self._tasks, []
        await asyncio.gather(*(stop_task(t, f"subscriber {self.name}") for t in tasks))

    def _connection(self, host: str, port: int) -> AbstractConnection:
        """A bare connection to the node at ``host``:``port``, of the client's kind: TLS for a
        ``rediss://`` URL (its ``ssl_*`` options with it), a Unix socket for ``unix://``."""
        if isinstance(self.redis, RedisCluster):
            node = self.redis.get_default_node()
            kind: type[AbstractConnection] = node.connection_class
            kwargs = dict(node.connection_kwargs)
        else:
            kind = self.redis.connection_pool.connection_class
            kwargs = dict(self.redis.connection_pool.connection_kwargs)
        # RESP2: under RESP3 the messages arrive as push frames that the client library's
        # push handler consumes instead of returning them to read_response()
        kwargs.update(socket_timeout=None, protocol=2)
        dropped = ("connection_pool", "retry", "himport_registry")
        prefixes = ("maint_notifications", "orig_", "oss_cluster")
        kept = {k: v for k, v in kwargs.items() if k not in dropped and not k.startswith(prefixes)}
        if issubclass(kind, UnixDomainSocketConnection):  # one node, at its socket's path
            return UnixDomainSocketConnection(**kept)
        kept.update(host=host, port=port)
        if issubclass(kind, SSLConnection):
            return SSLConnection(**kept)
        return Connection(**kept)

    async def _pinger(self, conn: AbstractConnection, answered: list[float]) -> None:
        """PING the subscription every PING_INTERVAL; close it when an answer is overdue
        (the pending read then fails, and the subscription is retried)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.PING_INTERVAL)
            if loop.time() - answered[0] > self.PONG_TIMEOUT:
                silent = loop.time() - answered[0]
                log.warning(
                    "event=subscription_silent subscriber=%s seconds=%.1f: no answer to PING",
                    self.name,
                    silent,
                )
                await conn.disconnect()
                return
            await conn.send_command("PING")

    async def _run(self, node: tuple[str, int], channels: list[str], ready: asyncio.Event) -> None:
        backoff = SUBSCRIBE.start()
        loop = asyncio.get_running_loop()
        while not self._closing:
            conn = self._connection(*node)
            pinger: asyncio.Task[None] | None = None
            try:
                await conn.connect()  # type: ignore[no-untyped-call]
                # one SSUBSCRIBE per slot: a cluster node refuses channels of several slots in
                # one command (CROSSSLOT), even when it serves them all
                by_slot: dict[int, list[str]] = {}
                for channel in channels:
                    by_slot.setdefault(key_slot(channel.encode()), []).append(channel)
                for group in by_slot.values():
                    await conn.send_command("SSUBSCRIBE", *group)
                confirmed = 0
                while confirmed < len(channels):
                    reply = await conn.read_response()
                    if reply and reply[0] == b"ssubscribe":
                        confirmed += 1
                self._down.discard(node)
                self._restored()
                if self.on_reset is not None:
                    self.on_reset()
                ready.set()
                backoff.reset()
                on_message = self.on_message
                answered = [loop.time()]  # when the last PING was answered
                pinger = asyncio.create_task(self._pinger(conn, answered))
                while True:
                    reply = await conn.read_response()
                    if reply is None:  # the pinger closed a silent connection
                        raise ConnectionError("subscription closed: no answer to PING")
                    if reply[0] == b"smessage":
                        try:
                            on_message(reply[1], reply[2])
                        except Exception:
                            # one bad message or consumer must not end the subscription
                            log.exception(
                                "event=subscriber_callback_failed subscriber=%s", self.name
                            )
                    elif reply[0] == b"pong":
                        answered[0] = loop.time()
                    elif reply[0] == b"sunsubscribe":
                        # the slot moved to another node (cluster resharding): resubscribe
                        raise ConnectionError("shard channel moved")
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, ConnectionError) as exc:
                if self._closing:
                    return
                self._down.add(node)
                if self.on_lost is not None:
                    try:
                        self.on_lost()
                    except Exception:
                        log.exception("event=subscriber_callback_failed subscriber=%s", self.name)
                wait = backoff.next()
                if self._lost is None:
                    self._lost = (loop.time(), 0)
                    log.warning(
                        "event=subscription_lost subscriber=%s node=%s:%s error=%r retry_in=%.2fs",
                        self.name,
                        *node,
                        exc,
                        wait,
                    )
                else:
                    self._lost = (self._lost[0], self._lost[1] + 1)
                    log.debug(
                        "event=subscription_retry_failed subscriber=%s node=%s:%s error=%r",
                        self.name,
                        *node,
                        exc,
                    )
                await asyncio.sleep(wait)
                if isinstance(self.redis, RedisCluster) or _sentinel_client(self.redis):
                    # a failover or resharding may have moved our slots (or the sentinels
                    # named another master): regroup and restart
                    if isinstance(self.redis, RedisCluster):
                        self.redis._initialize = True  # re-read the slots, not a cached map
                        with contextlib.suppress(RedisError, OSError):
                            await self.redis.initialize()
                    try:
                        await self._respawn()
                    except (RedisError, OSError, ConnectionError) as again:
                        # no master known yet (sentinels still electing): this task
                        # tries again after its next back-off
                        log.warning(
                            "event=subscription_regroup_failed subscriber=%s error=%r",
                            self.name,
                            again,
                        )
                        continue
                    return
            finally:
                if pinger is not None:
                    pinger.cancel()
                    with contextlib.suppress(BaseException):
                        await pinger
                with contextlib.suppress(Exception):
                    await conn.disconnect()

    def _restored(self) -> None:
        """Once every node's subscription is confirmed again after a loss: one line saying
        how long it took."""
        if self._lost is None or self._down:
            return
        since, tries = self._lost
        self._lost = None
        log.info(
            "event=subscription_restored subscriber=%s after=%.2fs failed_tries=%d",
            self.name,
            asyncio.get_running_loop().time() - since,
            tries,
        )

    async def _respawn(self) -> None:
        """(Cluster, sentinels) rebuild the per-node subscriptions after a topology change."""
        if self._closing:
            return
        groups = await node_groups(self.redis, self.channels)  # raises: nothing changed yet
        if self._closing:
            return
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = []
        self._start_tasks(groups)
