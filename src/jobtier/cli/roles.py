"""The commands that run a part of jobtier: api, worker, scheduler, persister, dispatcher, run,
and check (is one alive)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from jobtier import logs
from jobtier.cli.process import (
    STOP_SIGNALS,
    UNREACHABLE,
    default_name,
    exit_now_if_stuck,
    freeze_gc,
    on_signals,
    run_async,
)
from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.core.keys import Keys
from jobtier.metrics.snapshot import MetricsPublisher, Snapshot
from jobtier.runtime.listen import cannot_listen, is_ip_address

if TYPE_CHECKING:
    from jobtier.persist.db import Pool
    from jobtier.store.redis import RedisClient

log = logging.getLogger("jobtier.cli")


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.cli.process_args import process_options
    from jobtier.engine.queue import Queue
    from jobtier.worker.registry import TaskRegistry
    from jobtier.worker.runner import Worker

    sys.path.insert(0, os.getcwd())
    registry = TaskRegistry.load(args.tasks)

    async def main() -> int:
        async with await Queue.connect(settings, registry) as queue:
            worker = Worker(
                queue.store,
                registry,
                queues=args.queues,
                concurrency=args.concurrency,
                burst=args.burst,
                name=args.name,
                shutdown_grace=args.grace,
                blocked_warn=args.blocked_warn,
                executor=args.executor,
                processes=process_options(args),
            )
            on_signals(worker.stop, lambda: worker.stop(now=True))
            freeze_gc(settings)
            async with MetricsPublisher(queue.redis, queue.keys, "worker", [worker]):
                await worker.run()
        exit_now_if_stuck(worker.stuck, 0)
        return 0

    return run_async(main)


def cmd_scheduler(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.engine.queue import Queue
    from jobtier.scheduler import Scheduler

    async def main() -> int:
        from jobtier.persist.db import create_pool
        from jobtier.persist.schedule_store import ScheduleStore

        pool = await create_pool(settings.database_url, min_size=0, max_size=2, timeout=10)
        try:
            # (the scheduler submits through the store: no task is looked up)
            async with await Queue.connect(settings, catalog=False) as queue:
                scheduler = Scheduler(queue.store, batch=args.batch, schedules=ScheduleStore(pool))
                on_signals(scheduler.stop)
                async with MetricsPublisher(queue.redis, queue.keys, "scheduler", [scheduler]):
                    await scheduler.run()
        finally:
            await pool.close()
        return 0

    return run_async(main)


def cmd_api(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.api.app import create_app

    changes = {
        name: value
        for name, value in (
            ("api_host", args.host),
            ("api_port", args.port),
            ("api_workers", args.workers),
            ("api_server", args.server),
        )
        if value is not None
    }
    settings = settings.replace(**changes)
    if settings.api_server == "granian" and not is_ip_address(settings.api_host):
        raise ConfigError(
            f"granian listens on an IP address, not a name: JOBTIER_API_HOST (or --host) "
            f"{settings.api_host!r} (uvicorn, JOBTIER_API_SERVER=uvicorn, takes names)"
        )
    create_app(settings)  # fail here, with a clear message, on bad configuration
    if (why := cannot_listen(settings.api_host, settings.api_port)) is not None:
        raise ConfigError(
            f"the API cannot listen on {settings.api_host}:{settings.api_port} ({why}): "
            "JOBTIER_API_PORT (or --port) and JOBTIER_API_HOST (or --host) set where"
        )
    if (told := _wait_for_redis(settings)) is not None:
        signal.signal(told, signal.SIG_DFL)  # stopped while it waited: it ends by the signal
        os.kill(os.getpid(), told)
    for key, value in changes.items():  # the server processes read the environment
        os.environ["JOBTIER_" + key.upper()] = str(value)
    serve_api(settings)
    return 0


def _wait_for_redis(settings: Settings) -> signal.Signals | None:
    """Wait for a Redis fit to serve (``check_redis``: up to its patience, then the
    ConfigError that says why, one line), before any server process starts: in each of them
    the same failure was tracebacks, and granian's 'Unexpected exit'. The signal that stopped
    the wait, or None."""
    from jobtier.store.fitness import check_redis
    from jobtier.store.redis import connect

    told: list[signal.Signals] = []

    async def wait() -> int:
        main = asyncio.current_task()
        assert main is not None

        def stop(sig: signal.Signals) -> None:
            told.append(sig)
            main.cancel()

        for sig in STOP_SIGNALS:
            asyncio.get_running_loop().add_signal_handler(sig, stop, sig)
        redis = connect(settings)
        try:
            try:
                await check_redis(redis, settings)  # its warnings: the server processes' to log
            finally:
                await redis.aclose()
        except asyncio.CancelledError:  # (a second signal, or one as the connection closes)
            log.warning(
                "event=api_stopped_while_starting signal=%s: no server was started",
                told[0].name if told else "none",
            )
        return 0

    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        run_async(wait)
    finally:  # the servers' own handling after it, as with no wait (uvicorn re-raises a
        # signal it stopped for: under a handler left here, the process would exit 0)
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return told[0] if told else None


def serve_api(settings: Settings) -> None:
    """Run the API under granian or uvicorn (JOBTIER_API_SERVER), in the foreground."""
    log.info(
        "event=api_starting server=%s address=%s:%d workers=%d",
        settings.api_server,
        settings.api_host,
        settings.api_port,
        settings.api_workers,
    )
    if settings.api_server == "granian":
        from granian.constants import Interfaces, Loops
        from granian.server import Server

        Server(
            "jobtier.api.asgi:app_from_env",
            address=settings.api_host,
            port=settings.api_port,
            interface=Interfaces.ASGI,
            workers=settings.api_workers,
            loop=Loops.uvloop,
            factory=True,
            log_access=False,
            log_dictconfig=logs.granian_logging(settings.log_level, settings.log_format),
        ).serve()
    else:
        import uvicorn

        uvicorn.run(
            "jobtier.api.asgi:app_from_env",
            factory=True,
            host=settings.api_host,
            port=settings.api_port,
            workers=settings.api_workers,
            loop="uvloop",
            access_log=False,
            log_config=None,
        )


def cmd_persister(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.persist.persister import Persister
    from jobtier.store.redis import connect
    from jobtier.streams.group import replay_refused
    from jobtier.webhooks.deliveries import deliver_ended

    if args.replay_refused:

        async def replay() -> int:
            redis = connect(settings)
            try:
                moved = await replay_refused(redis, Keys(settings.prefix, settings.shards))
            finally:
                await redis.aclose()
            print(f"{moved} refused entries sent back to the transition logs")
            return 0

        return run_async(replay)

    def persister(redis: RedisClient, pool: Pool) -> Persister:
        return Persister(
            settings,
            redis,
            pool,
            args.name or default_name("persister"),
            concurrency=settings.persist_concurrency,
            outbox_ended=deliver_ended,
        )

    # the outbox relay holds one connection to listen on and takes one per batch
    relay = 2 if settings.outbox_relay else 0
    return _run_log_consumer(
        settings, "persister", settings.persist_concurrency + 1 + relay, persister
    )


def cmd_dispatcher(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.webhooks.dispatcher import Dispatcher

    def dispatcher(redis: RedisClient, pool: Pool) -> Dispatcher:
        return Dispatcher(settings, redis, pool, args.name or default_name("dispatcher"))

    return _run_log_consumer(settings, "dispatcher", 4, dispatcher)


class _LogConsumer(Protocol):
    """A process part that follows the transition logs with Postgres beside it."""

    keys: Keys

    def stop(self) -> None: ...
    async def run(self) -> None: ...
    def metrics(self) -> Snapshot: ...


def _run_log_consumer(
    settings: Settings,
    role: str,
    pool_size: int,
    build: Callable[[RedisClient, Pool], _LogConsumer],
) -> int:
    """Run a persister or a dispatcher until a signal: its Redis client and Postgres pool
    made here and closed on every way out, its metrics published meanwhile. Its Redis is
    checked at start as every role's is (``Store.connect``): one that could lose acknowledged
    jobs, does not answer within the start-up patience, or holds job records in a format
    this jobtier cannot read (a persister reads them too: its reconcile pass, its outbox
    relay's submits) is refused, and the process stops saying why."""
    from jobtier.persist.db import create_pool
    from jobtier.store.context import Store

    async def main() -> int:
        async with await Store.connect(settings) as store:
            pool = await create_pool(settings.database_url, min_size=0, max_size=pool_size)
            try:
                part = build(store.redis, pool)
                on_signals(part.stop)
                freeze_gc(settings)
                async with MetricsPublisher(store.redis, part.keys, role, [part]):
                    await part.run()
            finally:
                await pool.close()
        return 0

    return run_async(main)


def cmd_check(args: argparse.Namespace, settings: Settings) -> int:
    """Exit 0 when a process of ``args.role`` on this host published its metrics lately."""
    import socket

    from jobtier.metrics.snapshot import (
        FORGET_SECONDS,
        process_host,
        process_pid,
        read_snapshots,
    )
    from jobtier.store.redis import connect

    host = socket.gethostname()
    if args.pid is not None and args.any_host:
        print(
            "jobtier check: --pid names a process of this host: not with --any-host",
            file=sys.stderr,
        )
        return 2

    async def main() -> int:
        redis = connect(settings)
        try:
            keys = Keys(settings.prefix, settings.shards)
            snapshots = await read_snapshots(redis, keys, within=FORGET_SECONDS)
        except UNREACHABLE as exc:
            print(f"jobtier check: Redis unreachable ({exc})", file=sys.stderr)
            return 1
        finally:
            await redis.aclose()
        now = time.time()
        mine = [
            s
            for s in snapshots
            if s.role == args.role
            and (args.any_host or process_host(s.process) == host)
            and (args.pid is None or process_pid(s.process) == str(args.pid))
        ]
        fresh = [s for s in mine if now - s.at <= args.max_age]
        for snap in fresh:
            print(f"{snap.process}: alive, published {now - snap.at:.1f} s ago")
        if fresh:
            return 0
        where = "any host" if args.any_host else f"host {host}"
        if args.pid is not None:
            where = f"host {host} with pid {args.pid}"
        latest = max((s.at for s in mine), default=None)
        seen = (
            f"none in the last {FORGET_SECONDS / 3600:g} h"
            if latest is None
            else f"the latest {now - latest:.0f} s ago"
        )
        print(
            f"jobtier check: no {args.role} process on {where} published in the last "
            f"{args.max_age:g} s ({seen})",
            file=sys.stderr,
        )
        return 1

    return run_async(main)


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.dev.procs import LocalServiceError
    from jobtier.dev.stack import run

    try:
        code, stuck = run(args, settings, on_signals, run_async)
    except LocalServiceError as exc:
        print(f"jobtier run: {exc}", file=sys.stderr)
        return 1
    exit_now_if_stuck(stuck, code)
    return code
