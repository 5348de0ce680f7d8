"""The ``jobtier`` command."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import select
import sys
from pathlib import Path
from typing import Any

from jobtier import logs
from jobtier.cli import audit_cmd, breakers_cmd, manage, schedules_cmd, workers_cmd
from jobtier.cli.maintenance import (
    BENCHMARKS,
    cmd_bench,
    cmd_config,
    cmd_job_format,
    cmd_migrate,
    cmd_prune,
    cmd_reconcile,
    cmd_scripts,
    duration,
)
from jobtier.cli.process_args import (
    PROCESS_ARGS,
    at_least_one,
    lock_seconds,
    port,
    seconds,
    watch_seconds,
)
from jobtier.cli.roles import (
    cmd_api,
    cmd_check,
    cmd_dispatcher,
    cmd_persister,
    cmd_run,
    cmd_scheduler,
    cmd_worker,
)
from jobtier.config import ENV_PREFIX, Settings, env_name
from jobtier.core.errors import ConfigError
from jobtier.core.model import (
    MIGRATE_LOCK_TIMEOUT,
    MIGRATE_PATIENCE,
    WORKER_BLOCKED_WARN_SECONDS,
    WORKER_CONCURRENCY,
)
from jobtier.metrics.snapshot import ROLES
from jobtier.runtime import tracing

DESCRIPTION = """\
jobtier: asynchronous jobs for Python services, with a status tier that serves every
job's state in milliseconds. Configuration comes from JOBTIER_* environment variables
(`jobtier config` lists them with their values in effect)."""

log = logging.getLogger("jobtier.cli")


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


Arg = tuple[tuple[str, ...], dict[str, Any]]


def arg(*flags: str, **options: Any) -> Arg:
    """One ``add_argument`` call's arguments."""
    return flags, options


# Each command: its name, its function, its help (in the list of commands), its description
# (atop its own --help; one with line breaks keeps them), then its arguments.
COMMANDS: tuple[tuple[Any, ...], ...] = (
    (
        "run",
        cmd_run,
        "everything in one process, with a local Redis and Postgres (development)",
        "Start a local Redis and Postgres (data under --data-dir, loopback ports), then the API, "
        "a worker, the scheduler, the persister and the webhook dispatcher in one process. The servers are this "
        "command's own: it stops them when it ends, however it ends (Ctrl-C, SIGTERM, the "
        "terminal closing, even SIGKILL), and it never uses a server it did not start: a port "
        "taken by another server is refused (pick another with --redis-port/--pg-port). Ctrl-C "
        "once stops gracefully (running jobs get --grace seconds), twice at once.",
        arg("--tasks", default="jobtier.demo", help="task module[:attr] (default: the demo tasks)"),
        arg(
            "--data-dir",
            type=Path,
            default=Path(".data"),
            help="local services' data (default: .data)",
        ),
        arg(
            "--external",
            action="store_true",
            help="use JOBTIER_REDIS_URL / JOBTIER_DATABASE_URL; start no local services",
        ),
        arg("--redis-port", type=port, default=16379, help="local Redis port (default: 16379)"),
        arg("--pg-port", type=port, default=15432, help="local Postgres port (default: 15432)"),
        arg(
            "--api-port",
            type=port,
            help="the API's port (default: JOBTIER_API_PORT, 8000)",
        ),
        arg(
            "--concurrency",
            type=at_least_one,
            default=WORKER_CONCURRENCY,
            help=f"worker concurrency (default: {WORKER_CONCURRENCY})",
        ),
        arg(
            "--grace",
            type=seconds,
            default=30.0,
            help="seconds from Ctrl-C/SIGTERM by which the worker's running jobs must end; the "
            "rest are released to their queues (default: 30)",
        ),
    ),
    (
        "api",
        cmd_api,
        "serve the HTTP API",
        "Serve the HTTP API (submit, status, SSE, admin, metrics, dashboard) with granian or "
        "uvicorn. Needs JOBTIER_API_KEYS (key:tenant,…) and JOBTIER_ADMIN_KEY.",
        arg("--host", help="listen address (default: JOBTIER_API_HOST, 127.0.0.1)"),
        arg("--port", type=port, help="port (default: JOBTIER_API_PORT, 8000)"),
        arg(
            "--workers",
            type=at_least_one,
            help="server processes (default: JOBTIER_API_WORKERS, 1)",
        ),
        arg(
            "--server",
            choices=["granian", "uvicorn"],
            help="ASGI server (default: JOBTIER_API_SERVER, granian)",
        ),
    ),
    (
        "worker",
        cmd_worker,
        "run tasks",
        "Claim jobs and run them with the tasks of MODULE (every @task in it) or MODULE:ATTR (a "
        "TaskRegistry, a Task or a list of Tasks). It serves the queues of its tasks "
        "(@task(queue=...); 'default' for those that name none) unless --queues says otherwise, "
        "and never runs a job whose task it lacks: such a job is handed back, untouched, to a "
        "worker that has it. SIGTERM (or SIGINT, SIGHUP) stops claiming at once, lets running "
        "jobs finish until --grace seconds after it, then cancels and releases the rest to "
        "their queues (no attempt used); a second signal releases them at once.",
        arg("tasks", metavar="MODULE[:ATTR]", help="where the tasks are, e.g. myapp.tasks"),
        arg(
            "--queues",
            "-q",
            type=_queue_list,
            help="comma-separated queues to serve, in turn (default: the queues of its tasks)",
        ),
        arg(
            "--concurrency",
            "-c",
            type=at_least_one,
            default=WORKER_CONCURRENCY,
            help=f"jobs run at once (default: {WORKER_CONCURRENCY})",
        ),
        arg("--burst", action="store_true", help="drain the ready queues, then exit"),
        arg("--name", help="worker id (default: host:pid:random)"),
        arg(
            "--grace",
            type=seconds,
            default=30.0,
            help="seconds from SIGTERM by which running jobs must end; the rest are released to "
            "their queues (default: 30). A second signal releases them at once",
        ),
        arg(
            "--blocked-warn",
            type=watch_seconds,
            default=WORKER_BLOCKED_WARN_SECONDS,
            metavar="SECONDS",
            help="log event=worker_loop_blocked, naming the job and the line, when a task holds "
            f"the event loop this long: a blocking call in an async def (default: "
            f"{WORKER_BLOCKED_WARN_SECONDS:g}; 0: off)",
        ),
        *PROCESS_ARGS,
    ),
    (
        "scheduler",
        cmd_scheduler,
        "promote due jobs, fire cron schedules, reclaim expired leases",
        "Promote scheduled jobs when due, fire recurring (cron and interval) schedules, and "
        "requeue jobs whose worker stopped heartbeating. Run as many as you like: every move "
        "is an atomic script, and each slot of a schedule fires once however many run.",
        arg(
            "--batch",
            type=at_least_one,
            default=200,
            help="most jobs moved per script call (default: 200)",
        ),
    ),
    (
        "persister",
        cmd_persister,
        "write every transition to Postgres (write-behind)",
        "Read the shards' transition logs and write them to Postgres in batches, acknowledging "
        "only after commit. Run several: they share the work as one consumer group, and take "
        "over a dead one's pending entries.",
        arg("--name", help="consumer name (default: persister-host-pid); reuse it after a restart"),
        arg(
            "--replay-refused",
            action="store_true",
            help="send the entries Postgres refused (parked in each shard's log:refused stream) "
            "back to the logs for the persisters to try again, then exit",
        ),
    ),
    (
        "dispatcher",
        cmd_dispatcher,
        "send webhooks: signed POSTs of job transitions, retried for hours",
        "Follow the shards' transition logs as the dispatchers' consumer group and deliver "
        "webhooks: a job's own callback (its submit's `callback`) and the tenant's subscriptions "
        "(/v1/webhooks), signed the Standard Webhooks way with the tenant's secret. Deliveries "
        "and every attempt are recorded in Postgres (GET /v1/jobs/{id}/deliveries); a failed one "
        "is retried on JOBTIER_WEBHOOK_RETRY_SCHEDULE. Callback URLs must resolve to public "
        "addresses unless JOBTIER_WEBHOOK_ALLOWED_HOSTS names them. Run several: they share the "
        "logs as one group and the deliveries through Postgres, and a dead one's work is taken "
        "over. Needs JOBTIER_REDIS_URL and JOBTIER_DATABASE_URL (migrated).",
        arg(
            "--name", help="consumer name (default: dispatcher-host-pid); reuse it after a restart"
        ),
    ),
    (
        "prune",
        cmd_prune,
        "apply the Postgres retention now (persisters also do it, hourly by default)",
        "Apply the retention settings to JOBTIER_DATABASE_URL once: create the history's daily "
        "partitions ahead, drop (or, with JOBTIER_PG_HISTORY_DETACH=1, detach) those older than "
        "JOBTIER_PG_HISTORY_RETENTION_DAYS, and delete the jobs that finished more than "
        "JOBTIER_PG_JOB_RETENTION_DAYS ago, in small batches (0 keeps either forever). Waiting "
        "and running jobs are never deleted. Persisters do the same every "
        "JOBTIER_PRUNE_INTERVAL_SECONDS; one pass runs at a time.",
        arg(
            "--dry-run",
            action="store_true",
            help="print what would be created, dropped and deleted, with row counts; change "
            "nothing",
        ),
    ),
    (
        "reconcile",
        cmd_reconcile,
        "put back into Redis the jobs a failover lost and Postgres kept",
        "Compare the jobs Postgres changed in the last --since with Redis, and write back those "
        "Redis lacks or holds at an older version (a replica promoted after its primary died "
        "may lack the primary's last writes, which Postgres already has): waiting jobs to their "
        "queues, running ones back to their queue (they run again: at-least-once), finished ones "
        "with their final state and result. Never moves a job back: one Redis holds at "
        "Postgres's version or later is left alone. Shards without their format mark (their "
        "Redis lost its data) have every unfinished job compared too, however old, and are "
        "named (`jobtier job-format --upgrade` marks them). Safe to run at any time, and again. "
        "Persisters run it themselves when a Redis primary's run id changes "
        "(JOBTIER_RECONCILE_SECONDS).",
        arg(
            "--since",
            type=duration,
            default=900.0,
            help="how far back to look: 90s, 15m, 2h, 1d (default: 15m)",
        ),
        arg(
            "--dry-run",
            action="store_true",
            help="report what would be repaired; change nothing",
        ),
    ),
    (
        "migrate",
        cmd_migrate,
        "apply pending database migrations",
        "Apply the pending migrations to JOBTIER_DATABASE_URL, in one transaction, under a lock: "
        "safe to run from several deploys at once. A lock a migration needs (an ALTER TABLE's) "
        "is waited for --lock-timeout seconds at a time, so that a transaction left open on a "
        "table does not stall that table's readers and writers behind the migration; between "
        "tries it lets go of everything, logs event=migration_waiting naming the sessions that "
        "blocked it, and after --patience seconds gives up (exit 1), having changed nothing.",
        arg(
            "--lock-timeout",
            type=lock_seconds,
            default=MIGRATE_LOCK_TIMEOUT,
            metavar="SECONDS",
            help=f"longest wait for a lock, a try (default: {MIGRATE_LOCK_TIMEOUT:g})",
        ),
        arg(
            "--patience",
            type=seconds,
            default=MIGRATE_PATIENCE,
            metavar="SECONDS",
            help=f"give up after this long without the locks (default: {MIGRATE_PATIENCE:g})",
        ),
    ),
    (
        "job-format",
        cmd_job_format,
        "show whether this jobtier can read the job records in Redis; --upgrade them once",
        "This jobtier reads and writes job records in Redis in one format (3: a job's small "
        "fields packed in two values, no stored status document: it is rendered when read). "
        "Jobtiers before it wrote formats 1 and 2, and, before named queues, kept ready jobs in "
        "per-priority lists. Without options: per shard, whether this jobtier can read it "
        "(marked format 3, or never held a job) or what it holds that needs the upgrade; every "
        "process of this jobtier refuses to start on a deployment that needs it, naming this "
        "command. With --upgrade: rewrite every older job record into format 3 and move the old "
        "ready lists into the named queues' (each once; safe to run again, and to run again "
        "after it stopped half-way), then mark every shard format 3. Jobs carry on where they "
        "were: versions, leases, history and documents are kept. Stop processes of a jobtier "
        "from before format 3 first; those of the jobtier just before this one read format 3 "
        "and may keep running.",
        arg(
            "--upgrade",
            action="store_true",
            help="rewrite older job records into format 3, move the old ready lists, mark every "
            "shard; then show the result",
        ),
    ),
    (
        "scripts",
        cmd_scripts,
        "list, or prune, the Redis function libraries of jobtier versions",
        "The transition scripts are one Redis function library per jobtier version "
        "(jobtier_<digest of its code>), loaded by every process as it connects. A version's "
        "library stays in Redis after its last process stops. Without options: the jobtier "
        "libraries on each primary, this version's (the jobtier that runs this command) marked. "
        "With --prune: delete every one but this version's. Safe at any time: a process of "
        "another version still running loads its own again at its next call; run it after a "
        "deploy has finished, from the version deployed.",
        arg("--prune", action="store_true", help="delete every jobtier library but this version's"),
    ),
    (
        "bench",
        cmd_bench,
        "run a benchmark (each starts its own local services; results go to bench/results/)",
        "Run a benchmark program of the source tree. Each starts its own local Redis (and "
        "Postgres, servers, workers) on loopback ports, prints a table, compares against a "
        "baseline measured in the same run, and saves its results under bench/results/. "
        "Arguments after NAME go to the program (try `jobtier bench NAME --help`).\n\n"
        + "\n".join(f"  {name:12} {what}" for name, what in BENCHMARKS.items()),
        arg("name", choices=sorted(BENCHMARKS), metavar="NAME", help="which benchmark"),
        arg("args", nargs=argparse.REMAINDER, help="its own arguments"),
    ),
    (
        "check",
        cmd_check,
        "health check: is a ROLE process on this host alive?",
        "Exit 0 if a jobtier process of ROLE on this host published its metrics to Redis within "
        "--max-age seconds (every process does so every 2 s from its event loop, so a hung loop "
        "or a lost Redis connection fails the check), else 1 with the reason. For container "
        "health checks of the processes that serve no port: worker, scheduler, persister, "
        "dispatcher.",
        arg("role", choices=ROLES, metavar="ROLE", help=", ".join(ROLES)),
        arg("--max-age", type=float, default=15.0, help="seconds since the last publication (15)"),
        arg("--any-host", action="store_true", help="a process on any host will do (fleet check)"),
        arg(
            "--pid",
            type=int,
            help="only the process of this pid on this host (several of ROLE on one host)",
        ),
    ),
    (
        "config",
        cmd_config,
        "print the settings in effect (secrets masked)",
        "Print every setting as the JOBTIER_* variable that sets it, with the value this "
        "environment gives it (API keys, the admin key and the database URL masked).",
        arg("--table", action="store_true", help="print every setting as a markdown table"),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobtier",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, func, help, description, *args in COMMANDS:
        raw = "\n" in description
        formatter = argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter
        p = sub.add_parser(name, help=help, description=description, formatter_class=formatter)
        for flags, options in args:
            p.add_argument(*flags, **options)
        p.set_defaults(func=func)
    manage.add_commands(sub)
    breakers_cmd.add_commands(sub)
    schedules_cmd.add_commands(sub)
    audit_cmd.add_commands(sub)
    workers_cmd.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)  # the commands, rather than "COMMAND is required"
        return 2
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
        logs.setup(settings.log_level, settings.log_format)
        if args.command in (*ROLES, "config"):
            _warn_unknown_settings()
        if settings.otel and args.command in ROLES:
            tracing.setup(settings, args.command)
        try:
            code = int(args.func(args, settings))
            sys.stdout.flush()  # a reader gone is met here rather than at exit
            return code
        finally:
            tracing.shutdown()  # its last spans sent (a no-op unless setup made a provider)
    except ConfigError as exc:
        print(f"jobtier: configuration error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _reader_gone():
            raise  # not our output's: a fault like any other
        # the reader of our output stopped early (`jobtier config | head`): no traceback, and
        # none either from the interpreter flushing stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _warn_unknown_settings() -> None:
    """One warning per ``JOBTIER_*`` variable no setting reads (nor the client commands'
    ``JOBTIER_URL`` and ``JOBTIER_KEY``), with the one it may mean: misspelled, each was
    silently its default."""
    known = {env_name(f) for f in dataclasses.fields(Settings)} | {"JOBTIER_URL", "JOBTIER_KEY"}
    unknown = sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and k not in known)
    prefix = len(ENV_PREFIX)  # compared without it: every name shares it
    names = [env_name(f)[prefix:] for f in dataclasses.fields(Settings)]
    for name in unknown:
        near = difflib.get_close_matches(name[prefix:], names, n=1, cutoff=0.8)
        meant = f"; did you mean JOBTIER_{near[0]}?" if near else ""
        log.warning(
            "event=unknown_setting name=%s: no setting reads it, it changes nothing%s", name, meant
        )


def _reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (its write end polls POLLERR on
    Linux; POLLHUP elsewhere). Where that cannot be asked, any BrokenPipeError is taken for
    it, as before."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = select.POLLERR | select.POLLHUP
        return any(events & gone for _, events in poller.poll(0))
    except AttributeError:  # no poll() on this system
        return True
    except (OSError, ValueError):  # no descriptor (a test's capture), or a closed one
        return False


if __name__ == "__main__":
    sys.exit(main())
