"""`jobtier run`: local Redis and Postgres, then every jobtier part in one event loop.

For development and the README tour: the API (uvicorn, in-process), a worker with the demo
tasks, the scheduler and the persister share one process. The local services keep their
data under ``--data-dir`` and are reused by the next run. Production runs each part as its
own process (`jobtier api|worker|scheduler|persister`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import uvicorn

from jobtier.config import Settings
from jobtier.dev.redis import LocalRedis
from jobtier.metrics.snapshot import MetricsPublisher, Snapshot
from jobtier.queue import Queue
from jobtier.scheduler import Scheduler
from jobtier.worker.registry import TaskRegistry
from jobtier.worker.runner import Worker

log = logging.getLogger("jobtier.run")


class Part(Protocol):
    def stop(self) -> None: ...
    def metrics(self) -> Snapshot: ...


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3):
            return True
    except OSError:
        return False


def dev_keys(folder: Path) -> tuple[str, str]:
    """A development tenant key and admin key, made once and kept in the data folder."""
    path = folder / "dev-keys.json"
    if path.exists():
        keys = json.loads(path.read_text())
    else:
        folder.mkdir(parents=True, exist_ok=True)
        keys = {
            "tenant_key": "dev-" + secrets.token_urlsafe(16),
            "admin_key": "admin-" + secrets.token_urlsafe(16),
        }
        path.write_text(json.dumps(keys))
        path.chmod(0o600)
    return keys["tenant_key"], keys["admin_key"]


class LocalServices:
    """The local Redis and Postgres of `jobtier run`: started, or reused when a previous run
    (or another terminal) already serves them on their ports."""

    def __init__(self, folder: Path, redis_port: int, pg_port: int) -> None:
        self.folder = folder
        self.redis_port = redis_port
        self.pg_port = pg_port
        self.started: list[Any] = []

    def start(self) -> tuple[str, str]:
        from jobtier.dev.postgres import LocalPostgres

        if _listening(self.redis_port):
            log.info("event=local_redis_reused port=%d", self.redis_port)
        else:
            self.started.append(LocalRedis(self.folder / "redis", self.redis_port).start())
            log.info(
                "event=local_redis_started port=%d data=%s", self.redis_port, self.folder / "redis"
            )
        pg = LocalPostgres(self.folder / "pg", self.pg_port)
        if _listening(self.pg_port):
            log.info("event=local_postgres_reused port=%d", self.pg_port)
        else:
            self.started.append(pg.start())
            log.info(
                "event=local_postgres_started port=%d data=%s", self.pg_port, self.folder / "pg"
            )
        return f"redis://127.0.0.1:{self.redis_port}/0", pg.dsn

    def stop(self) -> None:
        for server in reversed(self.started):
            server.stop()


async def run_all(
    args: argparse.Namespace,
    settings: Settings,
    on_signals: Callable[[Callable[[], None]], None],
) -> int:
    from jobtier.api.app import create_app
    from jobtier.api.postgres import postgres_extension
    from jobtier.persist.db import create_pool, migrate
    from jobtier.persist.persister import Persister
    from jobtier.persist.schedule_store import ScheduleStore

    registry = TaskRegistry.load(args.tasks)
    services = None
    if not args.external:
        services = LocalServices(args.data_dir.resolve(), args.redis_port, args.pg_port)
        redis_url, database_url = await asyncio.to_thread(services.start)
        settings = settings.replace(redis_url=redis_url, database_url=database_url)
    if not settings.api_keys:
        tenant_key, admin_key = dev_keys(args.data_dir)
        settings = settings.replace(
            api_keys=f"{tenant_key}:dev", admin_key=settings.admin_key or admin_key
        )
    try:
        applied = await migrate(settings.database_url)
        if applied:
            log.info("event=migrated applied=%s", ",".join(applied))
        pool = await create_pool(settings.database_url, min_size=0, max_size=4)
        async with await Queue.connect(settings, registry) as queue:
            worker = Worker(queue, registry, concurrency=args.concurrency)
            scheduler = Scheduler(queue, store=ScheduleStore(pool))
            persister = Persister(settings, queue.redis, pool, "run-persister")
            parts: list[Part] = [worker, scheduler, persister]
            publisher = MetricsPublisher(queue.redis, queue.keys, "run", parts)
            publisher.start()
            app = create_app(settings, postgres_extension(settings))
            config = uvicorn.Config(
                app, host=settings.api_host, port=settings.api_port, loop="none",
                lifespan="on", log_config=None, access_log=False,
            )  # fmt: skip
            server = EmbeddedServer(config)

            def stop() -> None:
                server.should_exit = True
                for part in parts:
                    part.stop()

            on_signals(stop)
            runs = [
                asyncio.create_task(worker.run(), name="worker"),
                asyncio.create_task(scheduler.run(), name="scheduler"),
                asyncio.create_task(persister.run(), name="persister"),
                asyncio.create_task(server.serve(), name="api"),
            ]
            while not server.started and not runs[3].done():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            _welcome(settings)
            for task in asyncio.as_completed(runs):
                try:
                    await task
                except Exception as exc:
                    log.error("event=part_failed error=%r: stopping everything", exc)
                    stop()
            await publisher.stop()
        await pool.close()
    finally:
        if services:
            services.stop()
    return 0


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: `jobtier run` stops every part on the first
    SIGTERM/SIGINT (uvicorn's handlers would replace ours, and re-raise the signal once it
    has shut down)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _welcome(settings: Settings) -> None:
    key = next(iter(settings.tenant_keys()), "<your key>")
    base = f"http://{settings.api_host}:{settings.api_port}"
    print(
        f"""
jobtier is running: API {base}  (Ctrl-C stops everything)

  export JOBTIER_URL={base} JOBTIER_KEY={key}
  curl -s -X POST $JOBTIER_URL/v1/jobs -H "Authorization: Bearer $JOBTIER_KEY" \\
       -H 'Content-Type: application/json' -d '{{"type": "sleep", "payload": {{"seconds": 3}}}}'
  curl -s $JOBTIER_URL/v1/jobs/<id> -H "Authorization: Bearer $JOBTIER_KEY"
  curl -sN $JOBTIER_URL/v1/jobs/<id>/events -H "Authorization: Bearer $JOBTIER_KEY"

  admin key: {settings.admin_key}   dashboard: {base}/dashboard
""",
        file=sys.stderr,
        flush=True,
    )
