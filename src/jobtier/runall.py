"""`jobtier run`: local services, then every jobtier process as tasks of one event loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from jobtier.config import Settings
from jobtier.devservices import LocalRedis
from jobtier.queue import Queue
from jobtier.scheduler import Scheduler
from jobtier.worker.registry import TaskRegistry
from jobtier.worker.runner import Worker

log = logging.getLogger("jobtier.run")


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3):
            return True
    except OSError:
        return False


def start_local_redis(folder: Path, port: int) -> LocalRedis | None:
    """Start the local Redis, or reuse the one a previous `jobtier run` left running."""
    if _listening(port):
        log.info("event=local_redis_reused port=%d", port)
        return None
    server = LocalRedis(folder / "redis", port).start()
    log.info("event=local_redis_started port=%d data=%s", port, folder / "redis")
    return server


async def run_all(
    args: argparse.Namespace,
    settings: Settings,
    on_signals: Callable[[Callable[[], None]], None],
) -> int:
    registry = TaskRegistry.load(args.tasks)
    started: list[LocalRedis] = []
    if not args.external:
        server = start_local_redis(args.data_dir, args.redis_port)
        if server:
            started.append(server)
        settings = settings.replace(redis_url=f"redis://127.0.0.1:{args.redis_port}/0")
    try:
        async with await Queue.connect(settings, registry) as queue:
            worker = Worker(queue, registry, concurrency=args.concurrency)
            scheduler = Scheduler(queue)
            parts: list[Worker | Scheduler] = [worker, scheduler]

            def stop() -> None:
                for part in parts:
                    part.stop()

            on_signals(stop)
            log.info(
                "event=running redis=%s tasks=%s",
                settings.redis_url, ",".join(registry.names()),
            )  # fmt: skip
            results = await asyncio.gather(worker.run(), scheduler.run(), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    log.error("event=part_failed error=%r", result)
    finally:
        for server in started:
            server.stop()
    return 0
