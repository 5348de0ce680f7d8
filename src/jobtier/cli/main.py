"""The ``jobtier`` command."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from redis.exceptions import RedisClusterException, RedisError

from jobtier import logs
from jobtier.cli import manage as cli_admin
from jobtier.config import Settings, settings_table
from jobtier.core.errors import ConfigError
from jobtier.core.keys import Keys
from jobtier.metrics.snapshot import MetricsPublisher, Snapshot

if TYPE_CHECKING:
    from jobtier.persist.db import Pool
    from jobtier.store.format import ShardState
    from jobtier.store.redis import RedisClient

log = logging.getLogger("jobtier.cli.main")

DESCRIPTION = """\
jobtier: asynchronous jobs for Python services, with a status tier that serves every
job's state in milliseconds. Configuration comes from JOBTIER_* environment variables
(`jobtier config` lists them with their values in effect)."""

# what a command meets when Redis is not there (a cluster client that reaches no node raises
# RedisClusterException, which is not a RedisError)
UNREACHABLE = (RedisError, RedisClusterException, OSError)


def _run_async(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    try:
        import uvloop

        return uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main())


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal closed


def _on_signals(
    stop: Callable[[], None],
    stop_now: Callable[[], None] | None = None,
    on_exit: Callable[[], None] | None = None,
) -> None:
    """SIGTERM, SIGINT (Ctrl-C) and SIGHUP (its terminal closed) stop the process.

    The first: ``stop()``, graceful. The second: ``stop_now()``, no more waiting, but still
    the clean-up that keeps its word (held jobs released to their queues, servers stopped).
    The next one, or the second when there is no ``stop_now``: ``on_exit()``, then exit on
    the spot.
    """
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []

    def handler(sig: signal.Signals) -> None:
        received.append(sig)
        if len(received) == 1:
            log.info("event=signal signal=%s action=graceful_stop", sig.name)
            stop()
        elif len(received) == 2 and stop_now is not None:
            log.warning("event=signal signal=%s action=stop_now", sig.name)
            stop_now()
        else:
            log.warning("event=forced_exit signal=%s", sig.name)
            if on_exit is not None:
                on_exit()
            os._exit(1)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, handler, sig)


def _exit_now_if_stuck(stuck: int, code: int) -> None:
    """Exit without joining what the worker could not stop (sync tasks' threads, tasks that
    ignored their cancellation): their jobs were released, and a normal exit would wait for
    them, past the grace. Everything else has been closed by now."""
    if stuck:
        log.warning("event=exit_without_waiting stuck=%d: tasks still running were released", stuck)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)


# --- commands -------------------------------------------------------------------------------
def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
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
            )
            _on_signals(worker.stop, lambda: worker.stop(now=True))
            if settings.gc_freeze:
                # Start-up objects (modules, tasks, compiled scripts) live as long as the
                # process: frozen, the collector no longer walks them; a higher first
                # threshold runs it less often. Worker CPU per job 19.5 -> 15.5 µs, peak RSS
                # after 100K jobs 70 -> 71 MB (bench/throughput.py runs).
                gc.collect()
                gc.freeze()
                gc.set_threshold(20_000, 50, 100)
            async with MetricsPublisher(queue.redis, queue.keys, "worker", [worker]):
                await worker.run()
        _exit_now_if_stuck(worker.stuck, 0)
        return 0

    return _run_async(main)


def cmd_scheduler(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.engine.queue import Queue
    from jobtier.scheduler import Scheduler

    async def main() -> int:
        from jobtier.persist.db import create_pool
        from jobtier.persist.schedule_store import ScheduleStore

        pool = await create_pool(settings.database_url, min_size=0, max_size=2, timeout=10)
        try:
            async with await Queue.connect(settings) as queue:
                scheduler = Scheduler(queue.store, batch=args.batch, schedules=ScheduleStore(pool))
                _on_signals(scheduler.stop)
                async with MetricsPublisher(queue.redis, queue.keys, "scheduler", [scheduler]):
                    await scheduler.run()
        finally:
            await pool.close()
        return 0

    return _run_async(main)


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
    create_app(settings)  # fail here, with a clear message, on bad configuration
    for key, value in changes.items():  # the server processes read the environment
        os.environ["JOBTIER_" + key.upper()] = str(value)
    serve_api(settings)
    return 0


def serve_api(settings: Settings) -> None:
    """Run the API under granian or uvicorn (JOBTIER_API_SERVER), in the foreground."""
    log.info(
        "event=api_starting server=%s address=%s:%d workers=%d",
        settings.api_server, settings.api_host, settings.api_port, settings.api_workers,
    )  # fmt: skip
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


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.persist.db import migrate

    async def main() -> int:
        applied = await migrate(settings.database_url)
        print(f"applied: {', '.join(applied)}" if applied else "the schema is up to date")
        return 0

    return _run_async(main)


def cmd_job_format(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.core.keys import Keys
    from jobtier.store import format as job_format
    from jobtier.store.redis import connect

    async def main() -> int:
        redis = connect(settings)
        keys = Keys(settings.prefix, settings.shards)
        done = None
        try:
            if args.upgrade:
                done = await job_format.upgrade(redis, keys)
            states = await job_format.shard_states(redis, keys)
        except UNREACHABLE as exc:
            then = (
                "run it again once Redis answers: it goes on from where it stopped"
                if args.upgrade
                else "nothing changed"
            )
            print(
                f"jobtier job-format: Redis unreachable at JOBTIER_REDIS_URL ({exc}); {then}",
                file=sys.stderr,
            )
            return 1
        finally:
            await redis.aclose()
        if done is not None:
            differ = f" ({done.differ:,} render another document than the one they stored)"
            dropped = f" ({done.dropped:,} no longer queued: dropped from them)"
            print(
                f"rewrote {done.hashes:,} job hashes into format {job_format.NEWEST}"
                f"{differ if done.differ else ''}; moved {done.moved:,} jobs from the ready "
                f"lists of before named queues{dropped if done.dropped else ''}; marked "
                f"{done.shards} shards format {job_format.NEWEST}"
            )
        print(_format_states(states))
        return 0

    return _run_async(main)


def _format_states(states: Sequence[ShardState]) -> str:
    """``jobtier job-format``'s report of job_format.shard_states."""
    from jobtier.store import format as job_format

    n = len(states)
    readable = [s for s in states if s.readable]
    new = sum(1 for s in readable if s.new)
    lines = [
        f"readable: {len(readable)} of {n} shards (format {job_format.NEWEST}"
        + (f"; {new} never held a job, marked at the first process's start" if new else "")
        + ")"
    ]
    found = job_format.problems_by_kind(states)
    if found:
        lines.append(f"needs `{job_format.COMMAND}`: {n - len(readable)} of {n} shards")
        for problem, shards in found.items():
            lines.append(f"  {job_format.shard_list(shards)}: {problem}")
        old = sum(s.old_ready for s in states)
        if old:
            lines.append(f"  {old:,} jobs wait in the ready lists of before named queues")
        lines.append(
            "Processes of this jobtier refuse to start until it has run (once; "
            "the processes of the jobtier before this one may keep running meanwhile)."
        )
    return "\n".join(lines)


def cmd_scripts(args: argparse.Namespace, settings: Settings) -> int:
    from redis.exceptions import ResponseError

    from jobtier.store.redis import connect
    from jobtier.store.scripts import libraries, library, prune_libraries

    this = library().name
    deleted: list[tuple[str, str]] = []

    def show_deleted() -> None:
        for node, name in deleted:
            print(f"deleted {name}" + (f" on {node}" if node else ""))

    async def main() -> int:
        redis = connect(settings)
        try:
            if args.prune:
                await prune_libraries(redis, this, deleted)
            found = await libraries(redis)
        except ResponseError as exc:  # e.g. NOPERM: an ACL without FUNCTION LIST or DELETE
            show_deleted()
            print(
                f"jobtier scripts: Redis refused: {exc} (the command needs FUNCTION LIST, and "
                "FUNCTION DELETE for --prune)",
                file=sys.stderr,
            )
            return 1
        except UNREACHABLE as exc:
            show_deleted()
            done = "nothing changed" if not deleted else "the rest not deleted"
            print(
                f"jobtier scripts: Redis unreachable at JOBTIER_REDIS_URL ({exc}); {done}",
                file=sys.stderr,
            )
            return 1
        finally:
            await redis.aclose()
        show_deleted()
        for node, names in found:
            shown = [f"{n} (this version)" if n == this else n for n in names] or ["none"]
            print(f"{node + ': ' if node else ''}{', '.join(shown)}")
        others = sum(n != this for _, names in found for n in names)
        if others:
            print(
                f"{others} from other jobtier versions: `jobtier scripts --prune` deletes them "
                "(a process of another version still running loads its own again at its next "
                "call)."
            )
        return 0

    return _run_async(main)


def cmd_persister(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.persist.persister import Persister
    from jobtier.store.redis import connect
    from jobtier.streams.group import replay_refused

    if args.replay_refused:

        async def replay() -> int:
            redis = connect(settings)
            try:
                moved = await replay_refused(redis, Keys(settings.prefix, settings.shards))
            finally:
                await redis.aclose()
            print(f"{moved} refused entries sent back to the transition logs")
            return 0

        return _run_async(replay)

    def persister(redis: RedisClient, pool: Pool) -> Persister:
        return Persister(
            settings, redis, pool, args.name or default_name("persister"),
            concurrency=settings.persist_concurrency,
        )  # fmt: skip

    return _run_log_consumer(settings, "persister", settings.persist_concurrency + 1, persister)


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
    made here and closed on every way out, its metrics published meanwhile."""
    from jobtier.persist.db import create_pool
    from jobtier.store.redis import connect

    async def main() -> int:
        redis = connect(settings)
        pool = await create_pool(settings.database_url, min_size=0, max_size=pool_size)
        try:
            part = build(redis, pool)
            _on_signals(part.stop)
            if settings.gc_freeze:
                # As the worker's (cmd_worker): every entry read makes a few objects the
                # collector tracks; frozen start-up objects and a higher first threshold
                # took the persister's collections from 3.0 to 0.4 µs a transition (timed
                # with gc.callbacks over a 120K backlog; bench/results/persist.md has the
                # persister's CPU before and after).
                gc.collect()
                gc.freeze()
                gc.set_threshold(20_000, 50, 100)
            async with MetricsPublisher(redis, part.keys, role, [part]):
                await part.run()
        finally:
            await pool.close()
            await redis.aclose()
        return 0

    return _run_async(main)


def cmd_prune(args: argparse.Namespace, settings: Settings) -> int:
    import asyncpg

    from jobtier.persist.db import connect
    from jobtier.persist.retention import prune

    async def main() -> int:
        try:
            conn = await connect(settings.database_url, timeout=10)
        except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
            print(
                f"jobtier prune: cannot connect to Postgres at JOBTIER_DATABASE_URL ({exc}); "
                "check that it runs and that the URL is right",
                file=sys.stderr,
            )
            return 1
        try:
            report = await prune(conn, settings, dry_run=args.dry_run)
        except asyncpg.UndefinedTableError as exc:
            print(f"jobtier prune: {exc}: run `jobtier migrate` first", file=sys.stderr)
            return 1
        finally:
            await conn.close()
        if report is None:
            print("another prune pass (a persister's) is running now; nothing done")
            return 0
        print("\n".join(("dry run: nothing changed", *report.lines()) if args.dry_run
                        else report.lines()))  # fmt: skip
        return 0

    return _run_async(main)


ROLES = ("api", "worker", "scheduler", "persister", "dispatcher", "run")


def cmd_check(args: argparse.Namespace, settings: Settings) -> int:
    """Exit 0 when a process of ``args.role`` on this host published its metrics lately."""
    import socket

    from jobtier.metrics.snapshot import process_host, read_snapshots
    from jobtier.store.redis import connect

    host = socket.gethostname()

    async def main() -> int:
        redis = connect(settings)
        try:
            snapshots = await read_snapshots(redis, Keys(settings.prefix, settings.shards))
        except UNREACHABLE as exc:
            print(f"jobtier check: Redis unreachable ({exc})", file=sys.stderr)
            return 1
        finally:
            await redis.aclose()
        now = time.time()
        mine = [
            s for s in snapshots
            if s.role == args.role and (args.any_host or process_host(s.process) == host)
        ]  # fmt: skip
        fresh = [s for s in mine if now - s.at <= args.max_age]
        for snap in fresh:
            print(f"{snap.process}: alive, published {now - snap.at:.1f} s ago")
        if fresh:
            return 0
        where = "any host" if args.any_host else f"host {host}"
        latest = max((s.at for s in mine), default=None)
        seen = "none ever seen" if latest is None else f"the latest {now - latest:.0f} s ago"
        print(
            f"jobtier check: no {args.role} process on {where} published in the last "
            f"{args.max_age:g} s ({seen})",
            file=sys.stderr,
        )
        return 1

    return _run_async(main)


def default_name(role: str) -> str:
    import socket

    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from jobtier.dev.procs import LocalServiceError
    from jobtier.dev.stack import run

    try:
        code, stuck = run(args, settings, _on_signals, _run_async)
    except LocalServiceError as exc:
        print(f"jobtier run: {exc}", file=sys.stderr)
        return 1
    _exit_now_if_stuck(stuck, code)
    return code


BENCHMARKS = {
    "throughput": "no-op jobs end to end through workers, and claims per job, against one-job-per-call",
    "pickup": "submit-to-running latency with an idle worker; delayed-job lateness; idle CPU",
    "status_read": "GET /v1/jobs/{id} at 10K+ req/s: hot, spread and churning keys, near cache on and off",
    "compare": "jobtier beside BullMQ, SAQ, arq, Celery, RQ and Dramatiq: the same no-op jobs, same Redis",
    "persist": "transitions written to Postgres per second and write-behind lag, batched against one INSERT each",
    "schedule": "start lateness of 100K delayed jobs and of a burst of 10K due at once",
    "shutdown": "a worker's time from SIGTERM to exit against --grace, every slot busy",
    "history_rows": "history rows Postgres keeps per demo sleep job, progress coalesced or not",
    "transitions": "a job's Redis CPU, commands and AOF bytes per transition and command, two versions",
    "memory": "Redis bytes per job by state and payload size, both hash encodings, two versions",
    "nearcache_memory": "the near cache's memory per 100K status documents",
    "chaos": "every process and server killed at random under load, then every job audited",
    "cancel": "request-to-cancelled latency of a running job, pushed against heartbeat-only",
    "webhooks": "webhook deliveries per second to a loopback receiver; job throughput with and without the dispatcher",
    "flows": "a 10K-child fan-in: last child done to parent running, children's jobs/s against plain jobs",
    "console": "the console's job listing with 1M jobs in Postgres: per filter, plans, under load",
}


def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    """Run one of the benchmark programs of the source tree (bench/NAME.py)."""
    import subprocess

    import jobtier

    program = Path(jobtier.__file__).resolve().parents[2] / "bench" / f"{args.name}.py"
    if not program.exists():
        print(
            f"jobtier: {program} not found: the benchmarks live in the source tree (bench/); "
            "run this from a checkout",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, str(program), *args.args])


def cmd_admin(args: argparse.Namespace, settings: Settings) -> int:
    """``jobs``, ``dead-letters``, ``queues``: through the HTTP API (cli/manage.py)."""
    return cli_admin.run(args)


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    if args.table:
        print("| variable | default | meaning |\n|---|---|---|")
        for name, default, meaning in settings_table():
            print(f"| `{name}` | `{default}` | {meaning} |")
        return 0
    for key, value in settings.public().items():
        print(f"JOBTIER_{key.upper()}={value}")
    return 0


# --- parser ---------------------------------------------------------------------------------
def _queue_list(text: str) -> list[str]:
    from jobtier.core.names import QUEUE_NAME_RE

    names = [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in names if not QUEUE_NAME_RE.fullmatch(name)]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"queue names must match {QUEUE_NAME_RE.pattern}, separated by commas"
            + (f" (not {', '.join(map(repr, bad))})" if bad else "")
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobtier",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "run",
        help="everything in one process, with a local Redis and Postgres (development)",
        description="Start a local Redis and Postgres (data under --data-dir, loopback ports), "
        "then the API, a worker, the scheduler and the persister in one process. The servers "
        "are this command's own: it stops them when it ends, however it ends (Ctrl-C, SIGTERM, "
        "the terminal closing, even SIGKILL), and it never uses a server it did not start: a "
        "port taken by another server is refused (pick another with --redis-port/--pg-port). "
        "Ctrl-C once stops gracefully (running jobs get --grace seconds), twice at once.",
    )
    p.add_argument(
        "--tasks", default="jobtier.demo", help="task module[:attr] (default: the demo tasks)"
    )
    p.add_argument(
        "--data-dir", type=Path, default=Path(".data"), help="local services' data (default: .data)"
    )
    p.add_argument(
        "--external",
        action="store_true",
        help="use JOBTIER_REDIS_URL / JOBTIER_DATABASE_URL; start no local services",
    )
    p.add_argument(
        "--redis-port", type=int, default=16379, help="local Redis port (default: 16379)"
    )
    p.add_argument(
        "--pg-port", type=int, default=15432, help="local Postgres port (default: 15432)"
    )
    p.add_argument("--concurrency", type=int, default=50, help="worker concurrency (default: 50)")
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds from Ctrl-C/SIGTERM by which the worker's running jobs must end; the rest "
        "are released to their queues (default: 30)",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "api",
        help="serve the HTTP API",
        description="Serve the HTTP API (submit, status, SSE, admin, metrics, dashboard) with "
        "granian or uvicorn. Needs JOBTIER_API_KEYS (key:tenant,…) and JOBTIER_ADMIN_KEY.",
    )
    p.add_argument("--host", help="listen address (default: JOBTIER_API_HOST, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: JOBTIER_API_PORT, 8000)")
    p.add_argument("--workers", type=int, help="server processes (default: JOBTIER_API_WORKERS, 1)")
    p.add_argument(
        "--server", choices=["granian", "uvicorn"], help="ASGI server (default: JOBTIER_API_SERVER)"
    )
    p.set_defaults(func=cmd_api)

    p = sub.add_parser(
        "worker",
        help="run tasks",
        description="Claim jobs and run them with the tasks of MODULE (every @task in it) or "
        "MODULE:ATTR (a TaskRegistry, a Task or a list of Tasks). It serves the queues of its "
        "tasks (@task(queue=...); 'default' for those that name none) unless --queues says "
        "otherwise, and never runs a job whose task it lacks: such a job is handed back, "
        "untouched, to a worker that has it. SIGTERM (or SIGINT, SIGHUP) stops claiming at "
        "once, lets running jobs finish until --grace seconds after it, then cancels and "
        "releases the rest to their queues (no attempt used); a second signal releases them "
        "at once.",
    )
    p.add_argument("tasks", metavar="MODULE[:ATTR]", help="where the tasks are, e.g. myapp.tasks")
    p.add_argument(
        "--queues",
        "-q",
        type=_queue_list,
        help="comma-separated queues to serve, in turn (default: the queues of its tasks)",
    )
    p.add_argument(
        "--concurrency", "-c", type=int, default=50, help="jobs run at once (default: 50)"
    )
    p.add_argument("--burst", action="store_true", help="drain the ready queues, then exit")
    p.add_argument("--name", help="worker id (default: host:pid:random)")
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds from SIGTERM by which running jobs must end; the rest are released to "
        "their queues (default: 30). A second signal releases them at once",
    )
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser(
        "scheduler",
        help="promote due jobs and reclaim expired leases",
        description="Promote scheduled jobs when due and requeue jobs whose worker stopped "
        "heartbeating. Run as many as you like: every move is an atomic script.",
    )
    p.add_argument(
        "--batch", type=int, default=200, help="most jobs moved per script call (default: 200)"
    )
    p.set_defaults(func=cmd_scheduler)

    p = sub.add_parser(
        "persister",
        help="write every transition to Postgres (write-behind)",
        description="Read the shards' transition logs and write them to Postgres in batches, "
        "acknowledging only after commit. Run several: they share the work as one consumer "
        "group, and take over a dead one's pending entries.",
    )
    p.add_argument(
        "--name", help="consumer name (default: persister-host-pid); reuse it after a restart"
    )
    p.add_argument(
        "--replay-refused",
        action="store_true",
        help="send the entries Postgres refused (parked in each shard's log:refused stream) "
        "back to the logs for the persisters to try again, then exit",
    )
    p.set_defaults(func=cmd_persister)

    p = sub.add_parser(
        "dispatcher",
        help="send webhooks: signed POSTs of job transitions, retried for hours",
        description="Follow the shards' transition logs as the dispatchers' consumer group and "
        "deliver webhooks: a job's own callback (its submit's `callback`) and the tenant's "
        "subscriptions (/v1/webhooks), signed the Standard Webhooks way with the tenant's "
        "secret. Deliveries and every attempt are recorded in Postgres (GET "
        "/v1/jobs/{id}/deliveries); a failed one is retried on JOBTIER_WEBHOOK_RETRY_SCHEDULE. "
        "Callback URLs must resolve to public addresses unless JOBTIER_WEBHOOK_ALLOWED_HOSTS "
        "names them. Run several: they share the logs as one group and the deliveries through "
        "Postgres, and a dead one's work is taken over. Needs JOBTIER_REDIS_URL and "
        "JOBTIER_DATABASE_URL (migrated).",
    )
    p.add_argument(
        "--name", help="consumer name (default: dispatcher-host-pid); reuse it after a restart"
    )
    p.set_defaults(func=cmd_dispatcher)

    p = sub.add_parser(
        "prune",
        help="apply the Postgres retention now (persisters also do it, hourly by default)",
        description="Apply the retention settings to JOBTIER_DATABASE_URL once: create the "
        "history's daily partitions ahead, drop (or, with JOBTIER_PG_HISTORY_DETACH=1, "
        "detach) those older than JOBTIER_PG_HISTORY_RETENTION_DAYS, and delete the jobs "
        "that finished more than JOBTIER_PG_JOB_RETENTION_DAYS ago, in small batches (0 "
        "keeps either forever). Waiting and running jobs are never deleted. Persisters do "
        "the same every JOBTIER_PRUNE_INTERVAL_SECONDS; one pass runs at a time.",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be created, dropped and deleted, with row counts; change nothing",
    )
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser(
        "migrate",
        help="apply pending database migrations",
        description="Apply the pending migrations to JOBTIER_DATABASE_URL, in one transaction, "
        "under a lock: safe to run from several deploys at once.",
    )
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser(
        "job-format",
        help="show whether this jobtier can read the job records in Redis; --upgrade them once",
        description="This jobtier reads and writes job records in Redis in one format (3: a "
        "job's small fields packed in two values, no stored status document: it is rendered "
        "when read). Jobtiers before it wrote formats 1 and 2, and, before named queues, kept "
        "ready jobs in per-priority lists. Without options: per shard, whether this jobtier "
        "can read it (marked format 3, or never held a job) or what it holds that needs the "
        "upgrade; every process of this jobtier refuses to start on a deployment that needs "
        "it, naming this command. With --upgrade: rewrite every older job record into format "
        "3 and move the old ready lists into the named queues' (each once; safe to run again, "
        "and to run again after it stopped half-way), then mark every shard format 3. Jobs "
        "carry on where they were: versions, leases, history and documents are kept. Stop "
        "processes of a jobtier from before format 3 first; those of the jobtier just before "
        "this one read format 3 and may keep running.",
    )
    p.add_argument(
        "--upgrade",
        action="store_true",
        help="rewrite older job records into format 3, move the old ready lists, mark every "
        "shard; then show the result",
    )
    p.set_defaults(func=cmd_job_format)

    p = sub.add_parser(
        "scripts",
        help="list, or prune, the Redis function libraries of jobtier versions",
        description="The transition scripts are one Redis function library per jobtier "
        "version (jobtier_<digest of its code>), loaded by every process as it connects. A "
        "version's library stays in Redis after its last process stops. Without options: "
        "the jobtier libraries on each primary, this version's (the jobtier that runs this "
        "command) marked. With --prune: delete every one but this version's. Safe at any "
        "time: a process of another version still running loads its own again at its next "
        "call; run it after a deploy has finished, from the version deployed.",
    )
    p.add_argument(
        "--prune", action="store_true", help="delete every jobtier library but this version's"
    )
    p.set_defaults(func=cmd_scripts)

    p = sub.add_parser(
        "bench",
        help="run a benchmark (each starts its own local services; results go to bench/results/)",
        description="Run a benchmark program of the source tree. Each starts its own local Redis "
        "(and Postgres, servers, workers) on loopback ports, prints a table, compares against a "
        "baseline measured in the same run, and saves its results under bench/results/. "
        "Arguments after NAME go to the program (try `jobtier bench NAME --help`).\n\n"
        + "\n".join(f"  {name:12} {what}" for name, what in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", choices=sorted(BENCHMARKS), metavar="NAME", help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its own arguments")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "check",
        help="health check: is a ROLE process on this host alive?",
        description="Exit 0 if a jobtier process of ROLE on this host published its metrics "
        "to Redis within --max-age seconds (every process does so every 2 s from its event "
        "loop, so a hung loop or a lost Redis connection fails the check), else 1 with the "
        "reason. For container health checks of the processes that serve no port: worker, "
        "scheduler, persister, dispatcher.",
    )
    p.add_argument("role", choices=ROLES, metavar="ROLE", help=", ".join(ROLES))
    p.add_argument(
        "--max-age", type=float, default=15.0, help="seconds since the last publication (15)"
    )
    p.add_argument(
        "--any-host", action="store_true", help="a process on any host will do (fleet check)"
    )
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "config",
        help="print the settings in effect (secrets masked)",
        description="Print every setting as the JOBTIER_* variable that sets it, with the value "
        "this environment gives it (API keys, the admin key and the database URL masked).",
    )
    p.add_argument("--table", action="store_true", help="print every setting as a markdown table")
    p.set_defaults(func=cmd_config)

    cli_admin.add_commands(sub, cmd_admin)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        logs.setup(settings.log_level, settings.log_format)
        return int(args.func(args, settings))
    except ConfigError as exc:
        print(f"jobtier: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
