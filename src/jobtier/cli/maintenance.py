"""The commands that look after a deployment: migrate, job-format, scripts, prune, reconcile,
config, bench."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from jobtier.cli.process import UNREACHABLE, run_async
from jobtier.config import Settings, env_name, settings_table

if TYPE_CHECKING:
    from jobtier.store.format import ShardState

log = logging.getLogger("jobtier.cli")


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    import asyncpg

    from jobtier.persist.db import CONNECT_FAULTS, MigrationBlocked, migrate

    # Postgres lost or shutting down part-way (a restart, a failover): the migrations with it
    gone = (asyncpg.PostgresConnectionError, asyncpg.exceptions.OperatorInterventionError)

    async def main() -> int:
        try:
            applied = await migrate(
                settings.database_url, lock_timeout=args.lock_timeout, patience=args.patience
            )
        except MigrationBlocked as exc:
            print(f"jobtier migrate: {exc}", file=sys.stderr)
            return 1
        except CONNECT_FAULTS as exc:
            print(
                f"jobtier migrate: cannot connect to Postgres at JOBTIER_DATABASE_URL ({exc}); "
                "check that it runs and that the URL is right",
                file=sys.stderr,
            )
            return 1
        except gone as exc:
            print(
                f"jobtier migrate: Postgres went away ({exc!r}); nothing was changed: run it "
                "again once Postgres answers",
                file=sys.stderr,
            )
            return 1
        print(f"applied: {', '.join(applied)}" if applied else "the schema is up to date")
        return 0

    return run_async(main)


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

    return run_async(main)


def _format_states(states: Sequence[ShardState]) -> str:
    """``jobtier job-format``'s report of job_format.shard_states."""
    from jobtier.store import format as job_format

    n = len(states)
    readable = [s for s in states if s.readable]
    new = sum(1 for s in readable if s.new and not (s.mark == job_format.MARK and s.done))
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

    return run_async(main)


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
        print(
            "\n".join(
                ("dry run: nothing changed", *report.lines()) if args.dry_run else report.lines()
            )
        )
        return 0

    return run_async(main)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """Seconds from '90', '90s', '15m', '2h' or '1d' (an argparse type)."""
    value, unit = text.strip(), "s"
    if value[-1:].lower() in _UNITS:
        value, unit = value[:-1], value[-1].lower()
    try:
        seconds = float(value) * _UNITS[unit]
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a positive number, optionally followed by s, m, h or d"
        )
    return seconds


def cmd_reconcile(args: argparse.Namespace, settings: Settings) -> int:
    import asyncpg

    from jobtier.persist.reconcile import reconcile_once
    from jobtier.store.redis import connect

    async def main() -> int:
        redis = connect(settings)
        try:
            report = await reconcile_once(settings, redis, args.since, dry_run=args.dry_run)
        except UNREACHABLE as exc:
            print(
                f"jobtier reconcile: Redis unreachable at JOBTIER_REDIS_URL ({exc}); nothing "
                "changed",
                file=sys.stderr,
            )
            return 1
        except (TimeoutError, asyncpg.PostgresError) as exc:
            print(
                f"jobtier reconcile: cannot read Postgres at JOBTIER_DATABASE_URL ({exc}); "
                "nothing changed",
                file=sys.stderr,
            )
            return 1
        finally:
            await redis.aclose()
        print(
            "\n".join(
                ("dry run: nothing changed", *report.lines()) if args.dry_run else report.lines()
            )
        )
        return 0

    return run_async(main)


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


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    if args.table:
        print("| variable | default | meaning |\n|---|---|---|")
        for name, default, meaning in settings_table():
            print(f"| `{name}` | `{default}` | {meaning} |")
        return 0
    values = settings.public()
    for f in dataclasses.fields(settings):  # by each one's variable (OTEL_*: not JOBTIER_)
        print(f"{env_name(f)}={values[f.name]}")
    return 0
