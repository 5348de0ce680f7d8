"""`jobtier run`: local Redis and Postgres, then every jobtier part in one event loop.

For development and the README tour: the API (uvicorn, in-process), a worker with the demo
tasks, the scheduler, the persister and the webhook dispatcher share one process (webhooks may
go to loopback receivers unless JOBTIER_WEBHOOK_ALLOWED_HOSTS says otherwise); the servers
keep their data under ``--data-dir``. Production runs each part as its own process.

The servers belong to the run that started them, for its whole life and no longer: they are
its children, tied to it by the kernel (``jobtier.dev.procs``), so whatever ends the run ends
them, after the parts on an orderly stop. It never uses a server it did not start: one run per
data folder (a lock in it); a server of this folder left by an earlier run is stopped and
started again as this run's child (an adopted one would outlive this run too); anything else
on a port is refused, saying what answers there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import uvicorn

from jobtier.config import Settings
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.dev.local_redis import LocalRedis, PortOwner, redis_at
from jobtier.dev.procs import FolderLock, LocalServiceError, pid_alive, process_cwd, stop_pid
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import MetricsPublisher, Snapshot
from jobtier.runtime.listen import cannot_listen
from jobtier.scheduler import Scheduler
from jobtier.store.context import Store
from jobtier.streams.group import lag
from jobtier.worker.registry import TaskRegistry
from jobtier.worker.runner import Worker

log = logging.getLogger("jobtier.run")

# seconds a stopping run gives its persister, once the worker and the scheduler have ended,
# to write what they logged last (``_stop_after``)
FINAL_WRITE = 10.0
WATCH_EVERY = 0.5  # seconds between looks at the local servers (``_watch``)

OnSignals = Callable[
    [Callable[[], None], Callable[[], None] | None, Callable[[], None] | None], None
]
RunAsync = Callable[[Callable[[], Coroutine[Any, Any, int]]], int]


class Part(Protocol):
    def stop(self) -> None: ...
    def metrics(self) -> Snapshot: ...


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3):
            return True
    except OSError:
        return False


def dev_keys(folder: Path) -> tuple[str, str, str]:
    """A development tenant key, admin key and HTTP worker key, made once and kept in the
    data folder (a folder from before worker keys gets one added)."""
    path = folder / "dev-keys.json"
    keys = json.loads(path.read_text()) if path.exists() else {}
    made = {
        "tenant_key": "dev-" + secrets.token_urlsafe(16),
        "admin_key": "admin-" + secrets.token_urlsafe(16),
        "worker_key": "wk-dev-" + secrets.token_urlsafe(16),
    }
    if not made.keys() <= keys.keys():
        keys = made | keys
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(keys))
        path.chmod(0o600)
    return keys["tenant_key"], keys["admin_key"], keys["worker_key"]


class LocalServices:
    """The local Redis and Postgres of one `jobtier run` (see the module docstring)."""

    def __init__(self, folder: Path, redis_port: int, pg_port: int) -> None:
        self.folder = folder
        self.lock = FolderLock(folder)
        self.redis = LocalRedis(folder / "redis", redis_port)
        self.pg = LocalPostgres(folder / "pg", pg_port)

    def start(self) -> tuple[str, str]:
        """Start both (from the main thread: that is what ties them to this process).
        Returns the Redis URL and the Postgres DSN."""
        self.lock.acquire()
        self._start_redis()
        self._start_postgres()
        return self.redis.url, self.pg.dsn

    def _start_redis(self) -> None:
        redis, port = self.redis, self.redis.port
        self._stop_leftover("redis", redis.leftover_pid(), redis.folder, signal.SIGTERM)
        if _listening(port):
            owner = redis_at(port)
            here = redis.folder.resolve()
            if owner.folder == here and owner.pid and process_cwd(owner.pid) == here:
                # this folder's, without its pidfile
                self._stop_leftover("redis", owner.pid, redis.folder, signal.SIGTERM)
            else:
                raise _port_taken(port, owner, f"a Redis of {redis.folder}", "--redis-port")
        redis.start()
        log.info("event=local_redis_started port=%d pid=%s data=%s", port, redis.pid, redis.folder)

    def _start_postgres(self) -> None:
        pg, port = self.pg, self.pg.port
        pg.prepare()  # first: it may move the data folder (see jobtier.dev.local_postgres)
        self._stop_leftover("postgres", pg.leftover_pid(), pg.data, signal.SIGINT)
        if _listening(port):
            raise _port_taken(port, pg.describe_port(), f"a Postgres of {pg.data}", "--pg-port")
        pg.start()
        log.info("event=local_postgres_started port=%d pid=%s data=%s", port, pg.pid, pg.data)

    @staticmethod
    def _stop_leftover(name: str, pid: int | None, folder: Path, sig: int) -> None:
        """A server of this folder that outlived its run: stop it, to start our own."""
        if pid is None:
            return
        log.info(
            "event=local_%s_leftover pid=%d data=%s action=restart: a server of this folder "
            "outlived its run; restarting it as this run's own (an adopted one would not "
            "stop with this run)",
            name,
            pid,
            folder,
        )
        if not stop_pid(pid, sig):
            raise LocalServiceError(f"could not stop the leftover {name} server (pid {pid})")

    def stop(self) -> None:
        """Stop what this run started (Postgres first: the persister is done with it)."""
        try:
            for name, server in (("postgres", self.pg), ("redis", self.redis)):
                if server.proc is None:  # not started by this run: not ours to stop
                    continue
                pid = server.proc.pid
                server.stop()
                log.info("event=local_%s_stopped pid=%s", name, pid)
        finally:
            self.lock.release()

    def exited(self) -> str | None:
        """What ended, when a server this run started has exited under it (killed, crashed):
        the run cannot go on without it. Its process is reaped here."""
        for name, server in (("Redis", self.redis), ("Postgres", self.pg)):
            proc = server.proc
            if proc is None or (code := proc.poll()) is None:
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            return f"the local {name} (pid {proc.pid}) exited, {how}"
        return None

    def signal_now(self) -> None:
        """On the way out without clean-up: ask both to stop, without waiting for them."""
        for pid, sig in ((self.redis.pid, signal.SIGTERM), (self.pg.pid, signal.SIGINT)):
            if pid is not None and pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)


def _port_taken(port: int, owner: PortOwner, wanted: str, option: str) -> LocalServiceError:
    return LocalServiceError(
        f"port {port} is in use by {owner.description}, not by {wanted}. jobtier run uses "
        f"only servers it starts itself: stop that server, or give this run a free port "
        f"with {option} PORT"
    )


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@dataclass
class _Outcome:
    code: int = 0
    worker: Worker | None = None


def run(
    args: argparse.Namespace, settings: Settings, on_signals: OnSignals, run_async: RunAsync
) -> tuple[int, int]:
    """`jobtier run`. Returns the exit code and the worker's ``stuck`` count."""
    registry = TaskRegistry.load(args.tasks)  # a bad module fails before any server starts
    if args.api_port is not None:
        settings = settings.replace(api_port=args.api_port)
    if (why := cannot_listen(settings.api_host, settings.api_port)) is not None:
        # before the servers, the migrations and every part start, to stop again
        raise LocalServiceError(
            f"the API cannot listen on {settings.api_host}:{settings.api_port} ({why}): give "
            "it a free port with --api-port PORT (or JOBTIER_API_PORT)"
        )
    services: LocalServices | None = None
    if not args.external:
        services = LocalServices(args.data_dir.resolve(), args.redis_port, args.pg_port)
    outcome = _Outcome()
    # until the event loop takes the signals over, SIGTERM and SIGHUP interrupt the start-up
    # as Ctrl-C does, so that what has started is stopped below
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    try:
        if services is not None:
            redis_url, database_url = services.start()
            settings = settings.replace(redis_url=redis_url, database_url=database_url)
        if not settings.webhook_allowed_hosts:
            # development: a receiver on this machine may take the webhooks
            settings = settings.replace(webhook_allowed_hosts="127.0.0.1,::1,localhost")
        if not settings.api_keys:
            tenant_key, admin_key, worker_key = dev_keys(args.data_dir)
            settings = settings.replace(
                api_keys=f"{tenant_key}:dev",
                admin_key=settings.admin_key or admin_key,
                worker_keys=settings.worker_keys or worker_key,
            )
        outcome.code = run_async(
            lambda: run_all(args, settings, registry, on_signals, services, outcome)
        )
    except (KeyboardInterrupt, asyncio.CancelledError):
        log.info("event=stopped_during_startup")
    finally:
        if services is not None:
            services.stop()
    return outcome.code, outcome.worker.stuck if outcome.worker else 0


async def run_all(
    args: argparse.Namespace,
    settings: Settings,
    registry: TaskRegistry,
    on_signals: OnSignals,
    services: LocalServices | None,
    outcome: _Outcome,
) -> int:
    from jobtier.api.app import create_app
    from jobtier.api.records import postgres_extension
    from jobtier.api.sse import end_streams
    from jobtier.persist.db import CONNECT_FAULTS, MigrationBlocked, create_pool, migrate
    from jobtier.persist.persister import Persister
    from jobtier.persist.schedule_store import ScheduleStore
    from jobtier.webhooks.deliveries import deliver_ended
    from jobtier.webhooks.dispatcher import Dispatcher

    main = asyncio.current_task()
    assert main is not None
    makers: list[Part] = []  # the worker and the scheduler, which make transitions
    followers: list[Part] = []  # the persister and the dispatcher, which follow the logs
    making: list[asyncio.Task[Any]] = []  # the makers' runs
    persisting: list[asyncio.Task[Any]] = []  # the persister's run
    server: EmbeddedServer | None = None
    store: Store | None = None
    stopping: list[asyncio.Task[None]] = []

    def stop() -> None:
        if server is None:  # still starting: abandon the start-up
            main.cancel()
            return
        server.should_exit = True
        # its open streams end too (a console tab would hold the server up): a signal ends
        # them by itself, a SIGHUP or a part's failure does not
        end_streams(getattr(getattr(server, "lifespan", None), "state", None))
        for part in makers:
            part.stop()
        if not stopping:  # the followers once the makers' last transitions are written
            stopper = _stop_after(making, persisting, followers, store)
            stopping.append(asyncio.create_task(stopper))

    def stop_now() -> None:
        stop()
        if server is not None:
            server.force_exit = True
        if outcome.worker is not None:
            outcome.worker.stop(now=True)
        for task in stopping:  # no more waiting for the last writes
            task.cancel()
        for part in followers:
            part.stop()

    on_signals(stop, stop_now, services.signal_now if services else None)
    try:
        applied = await migrate(settings.database_url)
    except CONNECT_FAULTS as exc:
        raise LocalServiceError(
            f"cannot connect to Postgres at JOBTIER_DATABASE_URL ({exc}); check that it runs "
            "and that the URL is right"
        ) from None
    except MigrationBlocked as exc:
        raise LocalServiceError(f"jobtier migrate: {exc}") from None
    if applied:
        log.info("event=migrated applied=%s", ",".join(applied))
    pool = await create_pool(settings.database_url, min_size=0, max_size=6)
    failed = False
    try:
        async with await Queue.connect(settings, registry) as queue:
            worker = Worker(
                queue.store, registry, concurrency=args.concurrency, shutdown_grace=args.grace
            )
            outcome.worker = worker
            scheduler = Scheduler(queue.store, schedules=ScheduleStore(pool))
            persister = Persister(
                settings, queue.redis, pool, "run-persister", outbox_ended=deliver_ended
            )
            dispatcher = Dispatcher(settings, queue.redis, pool, "run-dispatcher")
            store = queue.store
            makers[:], followers[:] = [worker, scheduler], [persister, dispatcher]
            publisher = MetricsPublisher(queue.redis, queue.keys, "run", makers + followers)
            publisher.start()
            app = create_app(settings, postgres_extension(settings))
            config = uvicorn.Config(
                app,
                host=settings.api_host,
                port=settings.api_port,
                loop="none",
                lifespan="on",
                log_config=None,
                access_log=False,
            )
            server = EmbeddedServer(config)
            making[:] = [
                asyncio.create_task(worker.run(), name="worker"),
                asyncio.create_task(scheduler.run(), name="scheduler"),
            ]
            persisting[:] = [asyncio.create_task(persister.run(), name="persister")]
            runs = [
                *making,
                *persisting,
                asyncio.create_task(dispatcher.run(), name="dispatcher"),
            ]
            if services is not None:
                watch = _watch(services, stopping, stop_now)
                runs.append(asyncio.create_task(watch, name="local services"))
            # the API once the worker has advertised its tasks: a job submitted as soon as
            # the API answers is one the API knows a worker for (else 422)
            if await _worker_started(worker, runs) and not server.should_exit:
                runs.append(asyncio.create_task(_serve_api(server, settings), name="api"))
                while not server.started and not runs[-1].done():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                if server.started:
                    _welcome(settings, registry.names())
            for task in asyncio.as_completed(runs):
                try:
                    await task
                except Exception as exc:
                    failed = True
                    log.error("event=part_failed error=%r: stopping everything", exc)
                    stop()
            await asyncio.gather(*stopping, return_exceptions=True)  # ended with the runs
            await publisher.stop()
    finally:
        for task in stopping:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await pool.close()
    return 1 if failed else 0


async def _stop_after(
    making: list[asyncio.Task[Any]],
    persisting: list[asyncio.Task[Any]],
    followers: list[Part],
    store: Store | None,
) -> None:
    """Stop ``followers`` (the persister, the dispatcher) once the ``making`` runs (the
    worker's, the scheduler's) have ended and the persister has written what they logged:
    the releases of the jobs a stopping worker hands back, and what ended in its grace, are
    in Postgres when the run has stopped, rather than at its next start. Not longer than
    ``FINAL_WRITE`` once the makers ended (Postgres away: what is left is written by the next
    run), nor once the persister's run (``persisting``) ended by itself; a second signal
    cancels the wait (``stop_now``)."""
    try:
        if making:
            await asyncio.wait(making)
        if store is not None:
            async with asyncio.timeout(FINAL_WRITE):
                # the lag is Redis's to tell: asked again until none is left
                while await _unwritten(store, persisting):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    except Exception as exc:  # a best effort: Redis or Postgres away, the wait over
        log.warning("event=final_write_skipped error=%r: the next run writes the rest", exc)
    finally:
        for part in followers:
            part.stop()


async def _unwritten(store: Store, persisting: list[asyncio.Task[Any]]) -> bool:
    """Are transitions logged and not yet written, while the persister still runs?"""
    if all(task.done() for task in persisting):
        return False
    # a count (the cheapest: exact=1, pending=2): an entry trimmed while pending is 0 in it
    waiting, _ = await lag(store.redis, store.keys, exact=1, pending=2)
    return waiting > 0


async def _watch(
    services: LocalServices, stopping: list[asyncio.Task[None]], stop_now: Callable[[], None]
) -> None:
    """Until the run stops: raises ``LocalServiceError`` (a part failed: the run stops) once
    one of its local servers has exited under it, which nothing else would say: the parts
    would retry against a closed port for ever. Without its Redis nothing a running job does
    can be reported, nor a job handed back: the run stops at once (``stop_now``), rather than
    give the worker's jobs their grace and its reports their retries (a minute); those jobs
    run again once their leases expire, as after a kill."""
    while not stopping:
        if (why := services.exited()) is not None:
            redis_gone = services.redis.proc is not None and services.redis.proc.poll() is not None
            how = "at once (Redis is gone)" if redis_gone else "everything"
            log.error("event=local_service_exited %s: stopping %s", why, how)
            if redis_gone:
                stop_now()
            raise LocalServiceError(why)
        await asyncio.sleep(WATCH_EVERY)


async def _worker_started(worker: Worker, runs: list[asyncio.Task[Any]]) -> bool:
    """Until ``worker`` has started (True), or one of the parts' ``runs`` has ended, a
    failure or a stop (False: the caller's wait for them all reports it)."""
    started = asyncio.create_task(worker.started.wait())
    try:
        await asyncio.wait({started, *runs}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        started.cancel()
    return worker.started.is_set() and not any(run.done() for run in runs)


async def _serve_api(server: EmbeddedServer, settings: Settings) -> None:
    try:
        await server.serve()
    except SystemExit as exc:
        # uvicorn exits the process when it cannot start (the port taken): left to rise
        # from a task, SystemExit stops the event loop under the other parts' feet
        raise RuntimeError(
            f"the API could not start on {settings.api_host}:{settings.api_port} (uvicorn "
            f"exit {exc.code}): is the port free? JOBTIER_API_PORT sets it"
        ) from None


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: `jobtier run` stops every part on the first
    SIGTERM/SIGINT (uvicorn's handlers would replace ours, and re-raise the signal once it
    has shut down)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def command_hint() -> str:
    """The shell line that gives another terminal this install's ``jobtier`` command, or "" when
    PATH finds it already (``make run`` runs ``.venv/bin/jobtier``, which no shell has on PATH
    unless the virtualenv is activated)."""
    bin_dir = Path(sys.executable).parent
    script = bin_dir / "jobtier"
    found = shutil.which("jobtier")
    if found is not None and Path(found).absolute() == script.absolute():
        return ""
    if script.exists():
        where = shlex.quote(str(bin_dir.absolute()))
        return f'export PATH={where}:"$PATH"   # the jobtier command (or: . {where}/activate)'
    return f"alias jobtier='{sys.executable} -m jobtier.cli'   # the jobtier command"


def _welcome(settings: Settings, tasks: list[str] | None = None) -> None:
    """The banner: the exports, and a first job of the demo's ``sleep`` or, when ``tasks``
    (the names the worker runs) lack it, of the first of them."""
    key, tenant = next(iter(settings.tenant_keys().items()), ("<your key>", "<its tenant>"))
    payload: Any = {"seconds": 3}
    kind, yours = "sleep", ""
    if tasks is not None and "sleep" not in tasks:
        shown = ", ".join(tasks[:8]) + (", …" if len(tasks) > 8 else "")
        kind, payload = (tasks[0] if tasks else "<a task>"), None
        yours = f"  # the worker runs: {shown} (give each the payload it takes)\n"
    body, payload = json.dumps({"type": kind, "payload": payload}), json.dumps(payload)
    base = f"http://{settings.api_host}:{settings.api_port}"
    worker_key = next(iter(settings.worker_key_list()), None)
    workers = (
        f"  # a worker in another language (docs/http-workers.md), with the worker key:\n"
        f"  JOBTIER_URL={base} WORKER_KEY={worker_key} node examples/node-worker/worker.mjs\n"
        if worker_key
        else ""
    )
    hint = command_hint()
    path = f"  {hint}\n" if hint else ""
    print(
        f"""
jobtier is running: API {base}  (Ctrl-C stops everything)

{path}  export JOBTIER_URL={base} JOBTIER_KEY={key} JOBTIER_ADMIN_KEY={settings.admin_key}
  export JOBTIER_REDIS_URL={shlex.quote(settings.redis_url)} JOBTIER_DATABASE_URL={shlex.quote(settings.database_url)}
  # the second line: for `jobtier worker yourtasks` beside this one, and for psql
  # JOBTIER_KEY is tenant {tenant}'s: jobs of another tenant are not found with it (in SQL:
  #   SELECT jobtier.submit('{kind}', '{payload}', tenant => '{tenant}');)
{yours}  curl -s -X POST $JOBTIER_URL/v1/jobs -H "Authorization: Bearer $JOBTIER_KEY" \\
       -H 'Content-Type: application/json' -d '{body}'
  curl -s $JOBTIER_URL/v1/jobs/<id> -H "Authorization: Bearer $JOBTIER_KEY"
  curl -sN $JOBTIER_URL/v1/jobs/<id>/events -H "Authorization: Bearer $JOBTIER_KEY"
  jobtier jobs show <id>   # also: jobtier queues, jobtier dead-letters list (JOBTIER_ADMIN_KEY)
{workers}
  dashboard: {base}/dashboard (it asks for the admin key)
""",
        file=sys.stderr,
        flush=True,
    )
