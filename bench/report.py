"""The benchmarks page, generated from the results files: ``make bench-report``.

Reads every ``bench/results/*.json`` (the source of truth; the ``.md`` beside each is what the
bench printed) and writes ``docs/benchmarks.md``:

* each file's command, commit, machine and date, and whether its figures still describe the
  code: ``STALE`` when a commit after the recorded one changed a path the bench measures
  (``MEASURES``; ``git log --no-merges <commit>..<as-of> -- <paths>``: a merge is not a
  change of its own, the commits it brings in are; without ``--no-merges`` merging main into
  a branch that forked before the measurement would name the merge), ``unbacked`` when the recorded
  commit is not in the history or none is recorded, ``+local`` when the tree had uncommitted
  changes;
* every ratio between systems as the median of the per-run ratios (``ratios.py``) where the
  file keeps per-run figures; where it keeps medians only the page says so and gives the
  medians, no ratio made from them;
* the headline (``HEADLINE``): jobtier against BullMQ without and with its persister, each
  with the command that produced it.

The same block is written into README.md between ``<!-- bench-report:start -->`` and
``<!-- bench-report:end -->`` when both markers are there; without them only the page is
written, and the command says so.

Which file stands for each bench is chosen in one table, ``CHOSEN``; every other file is
listed as earlier or superseded. The stale check runs against the commit the page names
(HEAD when generated, kept in the page), so the page regenerates the same later on;
``--check`` regenerates in memory and fails when the committed page or README block differ.

Standard library only: no Redis, Postgres or jobtier import.

    python bench/report.py            # writes docs/benchmarks.md (and README's block)
    python bench/report.py --check    # exit 1 if either differs from a regeneration
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ratios import median_ratio, per_run_ratios

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
START, END = "<!-- bench-report:start -->", "<!-- bench-report:end -->"
AS_OF = re.compile(r"<!-- bench-report as-of: ([0-9a-f]{40}) -->")
X = "\N{MULTIPLICATION SIGN}"

# --- what each bench measures: a commit after the recorded one that touched these = STALE ----
JOB_PATH = (
    "src/jobtier/store", "src/jobtier/engine", "src/jobtier/worker", "src/jobtier/streams",
    "src/jobtier/core", "src/jobtier/config.py",
)  # fmt: skip
STATUS_PATH = (  # a status read: the near cache, the fast path, a miss's script
    "src/jobtier/status", "src/jobtier/api/asgi.py", "src/jobtier/api/app.py",
    "src/jobtier/api/jobs.py", "src/jobtier/store/lua",
)  # fmt: skip
MEASURES: dict[str, tuple[str, ...]] = {
    "compare": (*JOB_PATH, "src/jobtier/persist"),  # the persister rows too
    "throughput": JOB_PATH,
    "queues": JOB_PATH,
    "pickup": JOB_PATH,
    "cancel": (*JOB_PATH, "src/jobtier/api/jobs.py"),
    "flows": (*JOB_PATH, "src/jobtier/flows"),
    "schedule": (*JOB_PATH, "src/jobtier/scheduler.py"),
    "shutdown": ("src/jobtier/worker", "src/jobtier/runtime", "src/jobtier/cli"),
    "worker_execute": ("src/jobtier/worker",),
    "webhooks": (*JOB_PATH, "src/jobtier/webhooks"),
    "transitions": ("src/jobtier/store",),
    "transitions_profile": ("src/jobtier/store",),
    "lua_parts": ("src/jobtier/store",),
    "memory": ("src/jobtier/store",),
    "status_read": STATUS_PATH,
    "status_asgi": STATUS_PATH,
    "nearcache_memory": ("src/jobtier/status",),
    "api_scaling": ("src/jobtier/api", "src/jobtier/status"),
    "persist": ("src/jobtier/persist", "src/jobtier/streams"),
    "persist_pickup": ("src/jobtier/persist", "src/jobtier/streams"),
    "persist_shapes": ("src/jobtier/persist",),
    "by_state_statements": ("src/jobtier/persist",),
    "history_rows": ("src/jobtier/persist", "src/jobtier/worker"),
    "console": (
        "src/jobtier/api/console.py",
        "src/jobtier/api/console_records.py",
        "src/jobtier/api/console_flows.py",
        "src/jobtier/api/admin.py",
        "src/jobtier/persist/pg_reader.py",
        "src/jobtier/persist/queries.sql",
        "src/jobtier/persist/migrations",
    ),
    "chaos": ("src/jobtier",),
    "failover": ("src/jobtier",),  # the whole deployment on replicated Redis, as chaos
    "encryption": JOB_PATH,  # core/sealing.py, the submit and the worker
    "debounce": JOB_PATH,  # keyed.lua and the submit path (Queue.submit)
    "breaker": (*JOB_PATH, "src/jobtier/core/breaker.py"),  # breaker.lua and the worker's gate
    "batches": (*JOB_PATH, "src/jobtier/flows"),  # batch_*.lua, lib.lua's counts, hand-offs
    "checkpoint": ("src/jobtier/store", "src/jobtier/worker"),  # heartbeat.lua's save
    "process_pool": ("src/jobtier/worker",),
    "http_worker": (*JOB_PATH, "src/jobtier/api", "examples/node-worker"),
    "outbox": ("src/jobtier/persist", "src/jobtier/outbox", "src/jobtier/engine/produce.py"),
    "scaling_out": (*JOB_PATH, "src/jobtier/api", "src/jobtier/status"),  # api, worker, Redis
    # the submit's script call and WAIT (store/scripts.py, store/durable.py), the header
    "durable_submit": (
        "src/jobtier/store",
        "src/jobtier/api/durable_submit.py",
        "src/jobtier/api/jobs.py",
    ),
    "tracing": (
        "src/jobtier/runtime/tracing.py",
        "src/jobtier/worker",
        "src/jobtier/store",
        "src/jobtier/engine",
    ),
}

# --- which file stands for each bench (every other file: earlier, or another setting) --------
CHOSEN: dict[str, str] = {
    "compare-eb61405": "the newest set against BullMQ, at this code; pooled with compare-b07e823 for the headline (10 runs)",
    "compare-b07e823": "a set at this code in a noisy spell of the host (jobtier alone only 1.05x itself with the persister); pooled with compare-eb61405 for the headline",
    "compare-474e457": "a set at 474e457 in a slow spell of the host (absolute figures about 2x lower than on a quiet one)",
    "compare-9a9e596": "the set before, with the what-if without jobs_by_state's triggers; a loaded host (absolute figures about 3x lower)",
    "compare-5fd8cd0": "the set before, on a quiet host: the straight COPY in",
    "compare-e9c8c99": "the set before the straight COPY, with issues 30 and 32 in",
    "compare-redesign": "the newest jobtier set (against its code at 4ffac07; no peer)",
    "compare-09141d0-sameday": "the code before e03ddc5's worker changes, measured in the same spell as the four compare-e03ddc5 sets: their baseline (the spell's lag was longer than the days' before, for both)",
    "compare-e03ddc5": "four sets at e03ddc5 (with -2, -3, -4), in a spell whose lag was longer for the code before too (compare-09141d0-sameday)",
    "compare-fa159c5-batch4000": "the default batch (8,000) against 4,000 (--persister-env), in the same runs: 4,000 took more write-behind CPU (129 against 112 us a job), 0.95x end to end, and no shorter lag (p99 800 against 785 ms)",
    "compare-adf1865-batch": "the persister's default batch (8,000 transitions) against the old (2,000, --persister-env), in the same runs: 0.84 of the write-behind's CPU, 1.02x end to end, lag p50 346 against 434 ms but p99 711 against 606",
    "compare-cd481fd": "the headline: three sets (with -2, -3) at this code, one after another, nothing else of ours running, on the AMD EPYC host of 5f5c658's (load average 0.97 at the first set's start; 1.95 and 2.5 at the others', from the set before each); the changes since 5f5c658 on the measured path are comments in claim.lua and render.lua; the others (fail.lua's expiry cancel, the worker reporter's log of a fail's answer, keyed.py, the clients, the schedules' routes) are off the bench's path (no failure, no keyed job, no schedule)",
    "compare-5f5c658": "the headline before cd481fd's: three sets (with -2, -3) at this code, one after another, nothing else of ours running, on an AMD EPYC host slower than 0cde557's (BullMQ 3,763 to 3,924 jobs/s end to end against 7,277 to 8,978 there; load average 1.09 at the first set's start, from the tests just before); the changes since 0cde557 on the measured path: claim.lua's next look after 500 expired jobs and the job's own timeout (one more field read and answered per claimed job), submit.lua's timeout (one more argument per job), fail.lua's retry past an expiry (not on the bench's path: no failure)",
    "compare-a1afc2e-samehost": "a1afc2e (the code before 5f5c658's changes) measured on 5f5c658's host, right after its three sets: the control for them (0.95x BullMQ with the persister there, 0.91x to 0.94x at 5f5c658: the host's, not the code's)",
    "compare-0cde557": "the headline before 5f5c658's: three sets (with -2, -3) at this code, one after another, nothing else of ours running, on the Intel Xeon host of d7e72fa's (load average 0.97, 1.79, 1.26 at their starts), in a faster spell than d7e72fa's (BullMQ 7,277 to 8,978 jobs/s); the changes since d7e72fa on the measured path (a burst worker's outcomes sent before its last round, JobControl.replay_many's answer, the clients') are off the bench's path (no burst worker, no replay)",
    "compare-1587f19": "three sets at 1587f19, a commit before 0cde557 (flows/build.py only, off the measured path); the second and third were measured while that change was being made in the tree (+local)",
    "compare-d7e72fa": "the headline before 0cde557's: three sets (with -2, -3) at this code, one after another, nothing else of ours running, on the Intel Xeon host of c9f367e's (load average 0.88, 1.67, 1.72 at their starts); the changes since c9f367e on the measured path (a burst worker's last round over every shard, explain.lua's read of the expiry, the clients' seconds) are off the bench's path (no burst worker, no explain)",
    "compare-c9f367e": "the headline before d7e72fa's: three sets (with -2, -3) at this code, one after another, nothing else of ours running, on the Intel Xeon host of 6ff2b4d's (load average 0.22, 1.13, 1.54 at their starts), in a slower spell of the host than 6ff2b4d's (BullMQ 6,239 to 6,943 jobs/s against 6,818 to 8,237); the changes since 6ff2b4d on the measured path (job expiry: submit.lua's two more arguments a job, claim.lua's one more field in its HMGET of each job claimed; a JobSpec sent without the members it leaves unset) leave the write-behind's code as it was; compare-c9f367e-vs-549e938 measured jobtier against its 549e938 self in the same runs: 1.07x",
    "compare-c9f367e-vs-549e938": "jobtier at this code against its code before job expiry (549e938) in the same five runs, with BullMQ and the persister: 1.07x (per run 0.84 to 1.17), the claim's and the submit's changes cost nothing measurable",
    "compare-6ff2b4d": "the headline before c9f367e's: three sets (with -2, -3) at this code, one after another, nothing else of ours running, on the Intel Xeon host of bb7750f's (load average 0.73, 0.05, 0.04 at their starts); the changes since bb7750f on the measured path (schedules' dates, unique keys: keyed.lua, lib.lua's finish freeing a flagged job's key, replay.lua; submit.lua's due_of, one Lua function call a submit; keyed jobs' compensation) are off the bench's path but for that call: no schedule, no keyed submit, no replay",
    "compare-bb7750f": "three sets (with -2, -3) at bb7750f, the headline before 6ff2b4d's, one after another, nothing else of ours running, on the Intel Xeon host of 2f44097's (load average 0.47, 1.11, 1.03 at their starts); the changes since 2f44097 on the measured path (schedules changed in place and run now, a job promoted or its priority changed, jobs held behind concurrency keys counted: lib.lua marks a held job) are off the bench's path: no schedule, no promote, no concurrency key",
    "compare-2f44097": "three sets (with -2, -3) at 2f44097, one after another, nothing else of ours running, on the Intel Xeon host of f686d2e's (load average 0.97, 1.48, 1.69 at their starts); the changes since f686d2e on the measured path (a limited queue's cut claim releasing only its unstarted jobs' permits) are off the bench's path (no limited queue, no claim cut)",
    "compare-f686d2e": "six sets (with -2 to -6) at f686d2e, half an hour before 2f44097's, one after another, nothing else of ours running, on the Intel Xeon host of 9f66417's (load average 1.05, 1.70, 1.93, 1.25, 1.54, 1.72 at their starts); the changes to the measured path (a claim cut by a worker's stop given back, the outbox's cancel and its webhooks, the lease expiry's log line, the text log's escapes) are off the bench's path: no claim is cut, no row refused, no lease expires, the bench's processes log no job's text",
    "compare-9f66417": "the headline before f686d2e's: six sets (with -2 to -6) at 9f66417, one after another, on the same host (load average 1.52, 1.84, 1.31, 0.35, 1.20, 1.53 at their starts), in a faster spell than 20e1a20's an hour before (every system's absolute figures about 20 % higher)",
    "compare-20e1a20": "three sets (with -2, -3) at 20e1a20, the same bench path as 9f66417's (the review's mends after it are off it too), an hour before them (load average 0.91, 1.56, 1.85 at their starts)",
    "compare-874c7b3": "three sets (with -2, -3) at 874c7b3, the headline before 20e1a20's, on the same host (load average 0.52, 1.82, 1.43 at their starts); its changes to the measured path (queue blocks, unblock, fail.lua's message of a held attempt of a job asked to cancel) were off the bench's path",
    "compare-d071d67": "three sets (with -2, -3) at d071d67, an hour before 874c7b3's (which only moved a limited queue's permit block into block_queue), load average 0.96, 1.37, 1.81 at their starts",
    "compare-d4bb8ad": "three sets (with -2, -3) at d4bb8ad, half an hour before d071d67's, in a noisier spell (load average 1.2-2.0 at their starts; in two runs jobtier alone ran slower than jobtier with its persister in the same run)",
    "compare-6f56975": "the headline before: three sets (with -2, -3) at 6f56975, nothing else of ours running, on an Intel Xeon host whose absolute figures are about 2.4x lower than the AMD EPYC host of ef50b76's (the ratios hold); the bench's lag sampler reads no log entry where one is pending (93e55b9), where it read three of up to 100 transitions a shard every 50 ms",
    "compare-cbc01b4-conc3": "two sets (with -2) at cbc01b4 beside a persister of JOBTIER_PERSIST_CONCURRENCY=3 (--persister-env): 1.17x then 0.98x of the default's rate, lag p99 969 and 913 ms against 709 and 807: not a better default",
    "compare-aa7af5f": "three sets (with -2, -3) at aa7af5f, the same code on the measured path as 6f56975's (which only moved a key's name out of Keys), an hour before them on the same host: the spread between sets of one code",
    "compare-ef50b76": "the headline before: three sets (with -2, -3) at ef50b76 on the AMD EPYC host, nothing else of ours running; its lag sampler read the oldest and the newest pending entry whole on every shard every 50 ms",
    "compare-a1c623b": "the headline before ef50b76's: three sets (with -2, -3) at a1c623b, nothing else of ours running",
    "compare-33981cc": "three sets (with -2, -3) before the last read's mends (an entry's places derived once, the transitions an entry holds estimated in the Consumer both log readers share)",
    "compare-dd6fe5f": "three sets (with -2, -3) before the second read's mends (the lag's sample of pending log entries, EntryParts forgetting an earlier read's refusal), the first started a minute after a test run was stopped (load average 1.4)",
    "compare-a8bc56c": "three sets (with -2, -3) before the review of the one-entry log (its mends: the lag's sampling, the reads' sizes by transitions, logged()'s error replies)",
    "compare-4cf4ded": "three sets (with -2, -3) before a script call's transitions were logged in one entry (one entry per transition then)",
    "compare-ad044f4": "three sets (with -2, -3) before the last read's mends (resolve.lua's outcome record made one function, a constant moved to core.model)",
    "compare-cbb36b3": "three sets (with -2, -3) before the outbox relay's rows waiting for a worker (persist/outbox.py, off the job path), nothing else of ours running",
    "compare-97f222b": "three sets (with -2, -3) before the worker loop watch, resolve.lua's record for cancelled dependents and SavedCheckpoint's move to core, in a slower spell of the host (BullMQ 13,003 to 13,996 jobs/s against 15,116 and 16,133 at 43414bf; the third set the slowest)",
    "compare-43414bf": "two sets (with -2) before the last review's mends (the task declaration's checks, the result store's close, reconcile's marks: none on the job path's hot loop), nothing else running",
    "compare-b1857f4": "two sets (with -2) before the changes to the worker, the scheduler's leases, reconcile and the task catalogue, nothing else running",
    "compare-3ec8e16": "two sets (with -2) before the maintainer's read (worker_refusals.py, http.py, and a reflowed comment in persist/outbox.sql, a measured path), nothing else running",
    "compare-3ec8e16-vs-da56af4": "two sets (with -2) measuring this code against da56af4 (--baseline) in the same runs: 0.94x and 1.01x it (median of per-run ratios), jobtier alone 1.55x and 1.44x BullMQ against da56af4's 1.54x and 1.54x; the job path's changes since are a constant in core/names.py and engine/explain.py, which it does not run",
    "compare-da56af4": "two sets (with -2) before the changes to core/names.py, engine/explain.py, the outbox relay's recorded limits, nothing else running",
    "compare-6fb49bc": "two sets (with -2) before the outbox's key shards (migration 0021) and its status reads' window, in a quicker spell of the host (absolute figures about 1.8 times the 233a499 sets'; the ratios held)",
    "compare-233a499": "two sets (with -2) before the log-lag script took any group (the dispatchers' lag gauge) and the outbox relay refused unreadable rows alone, nothing else running",
    "compare-4ada475": "two sets (with -2) before store/calls.py's claim_replay (off the job path), the first begun at a load average of 2.9, just after a test run",
    "compare-843e831": "two sets (with -2) before jobtier run waited for its worker's start (Worker.started), in a quick spell of the host",
    "compare-32cc665": "two sets (with -2) before a written entry stayed the persister's until its XACK and claims were wrapped in sent_once, in a slow spell of the host (absolute figures about a third lower than the compare-3156885 sets', 25 minutes before; the ratios held)",
    "compare-3156885": "three sets (with -2, -3) before the second review's changes to the persister's reads, in a quicker spell: the first on a quiet host; in -2 BullMQ's runs were slow (Redis 128 us a job), in -3 jobtier's alone",
    "throughput": "the only file",
    "queues": "the only file",
    "pickup": "one queue (pickup-10-queues: ten)",
    "cancel": "the only file",
    "flows": "the only file",
    "schedule": "the only file",
    "shutdown": "the only file",
    "worker_execute": "the only file",
    "webhooks": "the newest, at this code (webhooks-loaded: earlier, at 6bfebf6)",
    "transitions": "the newest (15 runs against 1d30c84)",
    "transitions_profile": "this code's profile (-main: the scripts at main)",
    "lua_parts": "the only file",
    "memory": "the only file",
    "status_read": "10K req/s open loop, hot / spread / churn",
    "status_read-open20k-format3": "the newest 20K req/s set",
    "status_asgi": "the only file",
    "nearcache_memory": "the only file",
    "api_scaling": "the only file",
    "persist-85b87c1": "the newest: where each µs of the write-behind goes (--profile), the persister before the straight COPY (f421ffd) beside this tree, and the lag at a sustained 10K transitions/s",
    "persist-direct": "the straight COPY against a1d7d85, same run, with where each µs goes",
    "persist-redis": "the persister as deployed, with Redis's part of the write-behind, command by command (an A/A pair: 9d7ea37 has this tree's persister)",
    "persist": "an earlier backlog drain (no sustained-rate lag in it)",
    "persist-40c7fab": "the newest with the lag at a sustained 5K and 10K transitions/s",
    "persist_pickup": "the only file",
    "persist_shapes": "the only file",
    "by_state_statements": "the only file: jobs_by_state kept by the persister's statements costs Postgres what the triggers do (1.01x; 0.94x in a run of 48,000 before it)",
    "history_rows": "the only file",
    "console-stats": "this tree: 0020 and the reader's choice by the statistics, against 0009 and the jobs_by_state way in the same run",
    "console-0020": "0020's partial indexes against 0009 in the same run (a noisy host)",
    "console": "an earlier run on a quiet host, before 0020",
    "chaos-direct": "the long soak again at 13c7d5a, the straight COPY in",
    "chaos-hold": "250 kills with live jobs' rows held a second (JOBTIER_PERSIST_HOLD_SECONDS=1)",
    "chaos": "an earlier soak (before the straight COPY)",
    "failover-durable-on": "two replicas a master, durable submit on, 30 failovers a set-up",
    "failover-durable-off": "one replica a master, durable submit off, 30 failovers a set-up",
    "failover-durable-on-1replica": "one replica a master, durable submit on, 5 failovers",
    "failover-cluster-eabdc89": "the durable-on cluster set again at the final commit",
    "encryption": "the only file",
    "tracing": "the only file",
    "debounce": "the only file",
    "breaker": "the only file",
    "batches": "the only file",
    "checkpoint": "the only file",
    "process_pool": "the only file",
    "http_worker": "the only file",
    "outbox": "the only file",
    "scaling_out": "the only file",
    "durable_submit": "250 submits/s (-1000: 1K/s, its tail the shared machine's)",
}
HEADLINE = ("compare-cd481fd", "compare-cd481fd-2", "compare-cd481fd-3")  # pooled runs
NEWEST_JOBTIER = "compare-redesign"  # named beside a stale headline: jobtier's newest set
PERSISTER = "jobtier-persist"  # compare.py's name for jobtier with its persister


# --- reading the files ----------------------------------------------------------------------
@dataclass
class Result:
    """One results file: what it records of itself, and its standing against the history."""

    stem: str
    bench: str
    data: dict[str, Any]
    command: str | None = None
    commit: str | None = None  # as recorded
    date: str | None = None
    machine: str | None = None
    status: str = ""  # current / STALE ... / unbacked ...
    stale: bool = False
    unbacked: bool = False
    local: bool = False
    changed_by: list[str] = field(default_factory=list)  # commits since, on measured paths

    @property
    def label(self) -> str:
        tags = [self.status] + ["tree had local changes (+local)"] * self.local
        return "; ".join(tags)


def bench_of(stem: str) -> str:
    """The bench a results file belongs to: the longest known name it starts with."""
    for name in sorted(MEASURES, key=len, reverse=True):
        if stem == name or stem.startswith(name + "-"):
            return name
    return stem.split("-")[0]


def provenance(data: dict[str, Any]) -> dict[str, Any]:
    """command, commit, date and machine, wherever the bench put them (at the top, or in its
    ``environment`` / ``env``); None for what the file does not record."""
    found: dict[str, Any] = {}
    for where in (data, data.get("environment"), data.get("env")):
        if isinstance(where, dict):
            for key in ("command", "commit", "date", "machine"):
                if found.get(key) is None and where.get(key) is not None:
                    found[key] = where[key]
    return found


def machine_text(machine: Any) -> str | None:
    if not isinstance(machine, dict):
        return None
    kernel = str(machine.get("platform", "")).removeprefix("Linux-").split("-x86_64")[0]
    load = machine.get("load_average_at_start") or []
    text = f"{machine.get('nproc', '?')} CPUs {machine.get('cpu', '?')}, kernel {kernel}"
    return text + (f", load {load[0]} at start" if load else "")


Git = Callable[[Sequence[str]], "str | None"]


def run_git(args: Sequence[str]) -> str | None:
    """git's output in the repository, or None when it fails (an unknown commit)."""
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def judge(result: Result, as_of: str, git: Git = run_git) -> None:
    """Set ``result``'s status from its recorded commit and the history up to ``as_of``."""
    recorded = result.commit or ""
    result.local = "+local" in recorded
    sha = re.match(r"[0-9a-f]{7,40}\b", recorded)
    if sha is None:
        result.status, result.unbacked = "unbacked: no commit recorded", True
        return
    if git(["rev-parse", "-q", "--verify", f"{sha.group()}^{{commit}}"]) is None:
        result.status, result.unbacked = "unbacked: commit not in history", True
        return
    paths = MEASURES.get(result.bench)
    if paths is None:
        result.status = "not checked: no measured paths known for this bench"
        return
    log = git(["log", "--no-merges", "--format=%H", f"{sha.group()}..{as_of}", "--", *paths]) or ""
    # seven hex digits whatever the clone: git's own %h grows with the number of objects, so
    # the same history printed 8 digits here and 7 on a fresh clone, and the pages differed
    result.changed_by = [full[:7] for full in log.split()]
    if result.changed_by:
        result.stale = True
        n = len(result.changed_by)
        result.status = (
            f"STALE: {n} later commit{'s' * (n > 1)} changed the measured path "
            f"(newest `{result.changed_by[0]}`)"
        )
    else:
        result.status = "current"


def load(results: Path = RESULTS, as_of: str = "HEAD", git: Git = run_git) -> list[Result]:
    out = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        found = provenance(data)
        result = Result(
            stem=path.stem,
            bench=bench_of(path.stem),
            data=data,
            command=found.get("command"),
            commit=found.get("commit"),
            date=found.get("date"),
            machine=machine_text(found.get("machine")),
        )
        judge(result, as_of, git)
        out.append(result)
    return out


def markdown_only(results: Path = RESULTS) -> list[str]:
    """Results pages with no .json beside them: printed figures, nothing to read."""
    return sorted(p.stem for p in results.glob("*.md") if not p.with_suffix(".json").exists())


# --- formatting -----------------------------------------------------------------------------
def num(value: Any, digits: int = 0) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}{X}"


def runs_text(ratios: Sequence[float]) -> str:
    return ", ".join(f"{r:.2f}" for r in ratios) or "-"


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def code(text: str | None) -> str:
    return f"`{text}`" if text else "(not recorded)"


def median(values: Sequence[float]) -> float | None:
    return median_ratio(values)  # the same median, for figures that are not ratios


def dig(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


# --- compare: ratios from the runs ----------------------------------------------------------
def compare_ratio(result: Result, system: str, peer: str, mode: str) -> list[float]:
    return per_run_ratios(result.data.get("runs") or [], system, peer, mode)


def compare_median(result: Result, system: str, mode: str, key: str = "e2e_jobs_per_s") -> Any:
    return dig(result.data, "summary", system, mode, key)


def headline(by_stem: dict[str, Result], in_readme: bool = True) -> str:
    """The README block's text (also the page's first section): jobtier against BullMQ
    without and with its persister, each file's command beside its figures."""
    sets = [by_stem[s] for s in HEADLINE if s in by_stem]
    if not sets:
        return "No headline results file (HEADLINE in bench/report.py) is in bench/results.\n"
    rows, pooled_alone, pooled_persist = [], [], []
    for r in sets:
        alone = compare_ratio(r, "jobtier", "bullmq", "everysec")
        persist = compare_ratio(r, PERSISTER, "bullmq", "everysec")
        pooled_alone += alone
        pooled_persist += persist
        rates = " / ".join(
            num(compare_median(r, s, "everysec")) for s in ("jobtier", PERSISTER, "bullmq")
        )
        rows.append([
            f"`bench/results/{r.stem}.json`, {len(r.data.get('runs') or [])} runs, {r.date}",
            f"**{times(median_ratio(alone))}** ({runs_text(alone)})",
            f"**{times(median_ratio(persist))}** ({runs_text(persist)})",
            rates, code(r.command),
        ])  # fmt: skip
    if len(sets) > 1:
        rows.append([
            f"the {len(sets)} sets together, {len(pooled_alone)} runs",
            f"**{times(median_ratio(pooled_alone))}**",
            f"**{times(median_ratio(pooled_persist))}**", "", "",
        ])  # fmt: skip
    commits = sorted({r.commit or "(not recorded)" for r in sets})
    newer = ""
    if any(r.stale for r in sets) and NEWEST_JOBTIER in by_stem:
        r = by_stem[NEWEST_JOBTIER]
        base = compare_ratio(r, "jobtier", "jobtier-baseline", "everysec")
        newer = (
            f" (the newest jobtier set, `{r.stem}` at `{r.commit}`, has no peer: "
            f"{times(median_ratio(base))} the code of "
            f"`{dig(r.data, 'arguments', 'baseline')}`, {r.status})"
        )
    standing = sorted({r.label for r in sets})
    return (
        "End to end against BullMQ: no-op jobs, one worker process at concurrency 50, Redis "
        "AOF `everysec`, producer, worker, Redis (and Postgres) sharing the machine's 2 "
        "cores. Each ratio is the median of the per-run ratios (run i of jobtier over run i of "
        "BullMQ in the same interleaved set); each run's ratio in brackets. *With its "
        "persister*: `jobtier persister` writing every transition to a durable Postgres during "
        "the run, the record jobtier keeps; BullMQ keeps its jobs in Redis only.\n\n"
        + table(
            [
                "set",
                "jobtier vs BullMQ",
                "jobtier with its persister vs BullMQ",
                "jobs/s, medians: jobtier / with persister / BullMQ",
                "command",
            ],
            rows,
        )
        + f"\n\nMeasured at {', '.join(f'`{c}`' for c in commits)}; standing: "
        f"**{'; '.join(standing)}**{newer}. "
        + (
            "Generated by `make bench-report` from the results files (all of them: "
            "docs/benchmarks.md); edit those, not this block.\n"
            if in_readme
            else "\n"
        )
    )


def compare_section(results: list[Result]) -> str:
    rows, others = [], []
    for r in sorted(results, key=lambda r: r.date or "", reverse=True):
        if r.bench != "compare":
            continue
        runs = r.data.get("runs") or []
        systems = list(dig(r.data, "summary") or {})
        if "bullmq" not in systems:
            others.append(r)
            continue
        for mode in dig(r.data, "arguments", "modes") or ["everysec"]:
            alone = compare_ratio(r, "jobtier", "bullmq", mode)
            persist = compare_ratio(r, PERSISTER, "bullmq", mode)
            saq = compare_ratio(r, "jobtier", "saq", mode)
            saved = compare_median(r, "jobtier", mode, "e2e_vs_bullmq")
            rows.append([
                f"`{r.stem}`" + (" (chosen)" if r.stem in CHOSEN else ""), r.commit or "-",
                r.date or "-", "AOF off" if mode == "off" else "AOF everysec", len(runs),
                num(compare_median(r, "jobtier", mode)), num(compare_median(r, "bullmq", mode)),
                f"{times(median_ratio(alone))} ({runs_text(alone)})",
                f"{times(median_ratio(persist))} ({runs_text(persist)})" if persist else "-",
                f"{times(median_ratio(saq))}" if saq else "-",
                times(saved) if isinstance(saved, int | float) else "-",
                num(compare_median(r, PERSISTER, mode, "lag_p99_ms")),
                r.label,
            ])  # fmt: skip
    out = [
        "## Every set against BullMQ\n",
        "Every `bench/compare.py` file with BullMQ in it, newest first. Ratios recomputed here from each file's runs: the median of the "
        "per-run ratios. *Saved* is the ratio the file itself saved: until `0a61ca6`, "
        "compare.py printed a ratio of medians, which differs where runs spread.\n",
        table(
            [
                "file",
                "commit",
                "date",
                "Redis",
                "runs",
                "jobtier jobs/s (median)",
                "BullMQ jobs/s (median)",
                "jobtier vs BullMQ (per run)",
                "with persister vs BullMQ (per run)",
                "jobtier vs SAQ",
                "saved by the file",
                "persister lag p99 ms (median)",
                "standing",
            ],
            rows,
        ),
    ]
    for r in others:
        base = compare_ratio(r, "jobtier", "jobtier-baseline", "everysec")
        out.append(
            f"\n`{r.stem}` ({r.label}), no peer: jobtier at `{r.commit}` "
            f"{num(compare_median(r, 'jobtier', 'everysec'))} jobs/s against "
            f"{num(compare_median(r, 'jobtier-baseline', 'everysec'))} for the code of "
            f"`{dig(r.data, 'arguments', 'baseline')}` (medians), **{times(median_ratio(base))}** "
            f"it (per run {runs_text(base)}); {code(r.command)}."
        )
    return "\n".join(out) + "\n"


# --- the other benches' figures ---------------------------------------------------------------
def throughput_figures(r: Result) -> list[str]:
    s = r.data.get("summary") or {}
    runs = r.data.get("runs") or []
    ratio = [
        run["e2e"]["jobs_per_s"] / run["baseline"]["jobs_per_s"]
        for run in runs
        if dig(run, "e2e", "jobs_per_s") and dig(run, "baseline", "jobs_per_s")
    ]
    return [
        f"end to end {num(dig(s, 'e2e', 'jobs_per_s'))} jobs/s (AOF off "
        f"{num(dig(s, 'e2e_aof_off', 'jobs_per_s'))}), drain {num(dig(s, 'drain', 'jobs_per_s'))}, "
        f"enqueue {num(dig(s, 'enqueue_batch'))} (medians of {len(runs)} runs)",
        f"claim round trips a job {num(dig(s, 'e2e', 'claim_round_trips_per_job'), 3)}; the "
        f"baseline (one job per claim, one per completion) "
        f"{num(dig(s, 'baseline', 'claim_round_trips_per_job'), 3)} at "
        f"{num(dig(s, 'baseline', 'jobs_per_s'))} jobs/s",
        f"end to end over the baseline: **{times(median_ratio(ratio))}** (per run "
        f"{runs_text(ratio)})",
    ]


def persist_figures(r: Result) -> list[str]:
    medians = r.data.get("medians") or {}
    runs = r.data.get("runs") or []
    out = []
    for variant, got in medians.items():
        t = got.get("throughput") or {}
        line = (
            f"`{variant}`: backlog drained at {num(t.get('per_second'))} transitions/s, "
            f"CPU {num(t.get('persister_cpu_us'), 1)} (persister) + "
            f"{num(t.get('postgres_cpu_us'), 1)} (Postgres) µs a transition"
        )
        for key, sustained in got.items():
            if key.startswith("sustained_"):
                line += (
                    f"; offered {num(sustained.get('rate'))}/s: reached "
                    f"{num(sustained.get('achieved_rate'))}/s, lag p50 "
                    f"{num(sustained.get('p50_ms'))} ms, p99 {num(sustained.get('p99_ms'))} ms"
                    f", {num(sustained.get('unpersisted'))} left unwritten"
                )
        out.append(line)
    before, after = ("process-before", "process-after")
    ratio = [
        run[after]["throughput"]["per_second"] / run[before]["throughput"]["per_second"]
        for run in runs
        if dig(run, after, "throughput", "per_second")
        and dig(run, before, "throughput", "per_second")
    ]
    if ratio:
        out.append(
            f"this tree's persister over the code of `{r.data.get('before')}`, backlog drained: "
            f"**{times(median_ratio(ratio))}** (per run {runs_text(ratio)})"
        )
    out.append(f"medians of {len(runs)} runs")
    return out


def latency(s: Any, unit: str = "ms") -> str:
    return f"p50 {num(dig(s, 'p50'), 2)} {unit}, p99 {num(dig(s, 'p99'), 2)} {unit}"


def pickup_figures(r: Result) -> list[str]:
    s = r.data.get("summary") or {}
    return [
        f"submit → running: {latency(s.get('pickup_ms'))} ({num(dig(s, 'pickup_ms', 'n'))} jobs)",
        f"a delayed job's lateness: {latency(s.get('lateness_ms'))}",
    ]


def cancel_figures(r: Result) -> list[str]:
    s = r.data.get("summary") or {}
    return [f"`{k}` request → cancelled: {latency(v.get('cancelled_ms'))}" for k, v in s.items()]


def persist_pickup_figures(r: Result) -> list[str]:
    out = []
    for k, v in (r.data.get("summary") or {}).items():
        out.append(
            f"`{k}`: a lone transition to its commit p50 {num(v.get('pickup_p50_ms'), 1)} ms, "
            f"p90 {num(v.get('pickup_p90_ms'), 1)} ms, max {num(v.get('pickup_max_ms'), 1)} ms; "
            f"idle CPU persister {num(v.get('idle_persister_ms_per_s'), 1)} ms/s, Redis "
            f"{num(v.get('idle_redis_ms_per_s'), 1)} ms/s ({num(v.get('trials'))} trials)"
        )
    return out


def status_read_figures(r: Result) -> list[str]:
    rows = [
        row for row in r.data.get("summary") or [] if str(row.get("mode", "")).startswith("open")
    ]
    return [
        f"`{row.get('config')}` {row.get('mix')} at {row.get('mode')}: p50 {num(row.get('p50'), 2)} "
        f"ms, p99 {num(row.get('p99'), 2)} ms, {num(row.get('errors'))} errors "
        f"({row.get('runs')} runs; medians as the file keeps them)"
        for row in rows
    ]


def webhooks_figures(r: Result) -> list[str]:
    per = r.data.get("jobs_per_second") or {}
    off = per.get("off") or []
    out = [f"deliveries {num(r.data.get('deliveries_per_second'))}/s"]
    for key, what in (("on", "delivering every job's webhook"), ("follow", "following only")):
        got = [a / b for a, b in zip(per.get(key) or [], off, strict=False) if b]
        out.append(f"no-op jobs with the dispatcher {what}, over dispatcher off: "
                   f"**{times(median_ratio(got))}** (per run {runs_text(got)})")  # fmt: skip
    return out


def schedule_figures(r: Result) -> list[str]:
    out = []
    for variant, got in (r.data.get("summary") or {}).items():
        out.append(
            f"`{variant}`: 100K due over a minute, start lateness p50 "
            f"{num(got.get('spread.start_lateness_ms.p50'))} ms, p99 "
            f"{num(got.get('spread.start_lateness_ms.p99'))} ms, max "
            f"{num(got.get('spread.start_lateness_ms.max'))} ms"
        )
    return out


def flows_figures(r: Result) -> list[str]:
    s = r.data.get("summary") or {}
    return [
        f"a 10K-child fan-in, last child done → parent running: {latency(s.get('fan_in_ms'))}"
        f" (Redis's clock: {latency(s.get('fan_in_redis_ms'))})",
        f"the children end to end {num(s.get('children_jobs_per_s'))} jobs/s, "
        f"{num(s.get('flow_redis_cpu_us_per_job'))} µs of Redis CPU each; plain jobs "
        f"{num(s.get('plain_jobs_per_s'))} jobs/s, {num(s.get('plain_redis_cpu_us_per_job'))} µs",
    ]


def transitions_figures(r: Result) -> list[str]:
    """The three transitions together, before (the baseline's scripts) and after, summed
    from the file's medians; Redis CPU after over before run by run."""
    parts = ("submit", "claim", "complete")

    def total(side: Any, key: str) -> float | None:
        got = [dig(side, p, key) for p in parts]
        return sum(got) if all(isinstance(g, int | float) for g in got) else None

    s = r.data.get("summary") or {}
    out = []
    for side in ("before", "after"):
        out.append(
            f"{side} (medians, summed over the three transitions): Redis CPU "
            f"{num(total(s.get(side), 'redis_cpu_us_per_job'))} µs / script "
            f"{num(total(s.get(side), 'script_us_per_job'), 1)} µs / AOF "
            f"{num(total(s.get(side), 'aof_bytes_per_job'))} B / "
            f"{num(total(s.get(side), 'commands_per_job'), 2)} commands a job; a status read "
            f"{num(dig(s, side, 'read', 'redis_cpu_us_per_job'))} µs"
        )
    ratio = []
    for run in r.data.get("runs") or []:
        a, b = (
            total(run.get("after"), "redis_cpu_us_per_job"),
            total(run.get("before"), "redis_cpu_us_per_job"),
        )
        if a is not None and b:
            ratio.append(a / b)
    out.append(
        f"Redis CPU a job, after over before: **{times(median_ratio(ratio))}** (per run "
        f"{runs_text(ratio)}; {sum(x < 1 for x in ratio)} of {len(ratio)} runs lower)"
    )
    return out


def queues_figures(r: Result) -> list[str]:
    out = []
    for case, runs in (r.data.get("results") or {}).items():
        rates = [
            run["jobs_per_s"] for run in runs if isinstance(run.get("jobs_per_s"), int | float)
        ]
        out.append(f"{case}: {num(median(rates))} jobs/s (median of {len(rates)} runs)")
    return out


def nearcache_figures(r: Result) -> list[str]:
    runs = r.data.get("runs") or []
    mib = 1 << 20
    py = median([run["python_bytes"] / mib for run in runs])
    rss = median([run["rss_bytes"] / mib for run in runs])
    return [f"near cache full: {num(py, 1)} MiB of Python objects, {num(rss, 1)} MiB RSS "
            f"(medians of {len(runs)} processes)"]  # fmt: skip


def failover_figures(r: Result) -> list[str]:
    """Per run (set-up, durable submit on or off): jobs lost and run twice, and the seconds
    from a master's kill until submits on its shards succeed again."""
    out = []
    for run in r.data.get("runs") or []:
        if run.get("error"):
            out.append(f"{run.get('setup')}: did not take place ({run['error'].splitlines()[0]})")
            continue
        a, back = run.get("audit") or {}, dig(run, "recovery", "submits_back") or {}
        out.append(
            f"{run.get('setup')}, durable {'on' if run.get('durable') else 'off'}: "
            f"{len(run.get('failovers') or [])} failovers, {num(dig(a, 'lost', 'count'))} of "
            f"{num(a.get('acknowledged'))} acknowledged submits lost, "
            f"{num(a.get('duplicate_executions'))} jobs run twice; submits back after "
            f"{num(back.get('median'), 2)} s median, {num(back.get('max'), 2)} s max"
        )
    return out


FIGURES: dict[str, Callable[[Result], list[str]]] = {
    "schedule": schedule_figures,
    "flows": flows_figures,
    "transitions": transitions_figures,
    "queues": queues_figures,
    "nearcache_memory": nearcache_figures,
    "throughput": throughput_figures,
    "persist": persist_figures,
    "pickup": pickup_figures,
    "cancel": cancel_figures,
    "persist_pickup": persist_pickup_figures,
    "status_read": status_read_figures,
    "webhooks": webhooks_figures,
    "failover": failover_figures,
}


def figures_section(results: list[Result]) -> str:
    out = [
        "## The chosen file of each bench\n",
        "One file stands for each bench (`CHOSEN` in bench/report.py says which and why). "
        "Figures are read from the file; where a file keeps only medians they are given as "
        "medians, and no ratio is made from them. Benches with no reader here: see their "
        ".md.\n",
    ]
    for r in results:
        if r.stem not in CHOSEN or r.bench == "compare":
            continue
        out.append(f"### `{r.stem}`: {CHOSEN[r.stem]}\n")
        out.append(
            f"- {code(r.command)}, commit {code(r.commit)}, {r.date or '(date not recorded)'}"
            f", {r.machine or '(machine not recorded)'}"
        )
        out.append(f"- standing: **{r.label}**")
        reader = FIGURES.get(r.bench)
        try:
            got = reader(r) if reader else ["(no reader here: see the file's .md)"]
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            got = [f"(the file's shape is not the one this reader knows: {exc!r})"]
        out.extend(f"- {line}" for line in got)
        out.append("")
    return "\n".join(out)


SETTINGS = frozenset({"environment", "env", "machine", "versions", "arguments", "args", "settings"})


def keeps_runs(data: Any) -> bool:
    """Whether a file keeps figures run by run (somewhere a list of two or more figures or
    records, outside its settings), not only their medians."""
    if isinstance(data, dict):
        return any(keeps_runs(v) for k, v in data.items() if k not in SETTINGS)
    if isinstance(data, list):
        figures = [x for x in data if isinstance(x, int | float | dict) and not isinstance(x, bool)]
        return len(figures) >= 2 or any(keeps_runs(x) for x in data)
    return False


def files_section(results: list[Result], md_only: list[str]) -> str:
    rows = [
        [f"`{r.stem}`", r.bench, "chosen" if r.stem in CHOSEN else "earlier / other setting",
         code(r.command), r.commit or "(not recorded)", r.date or "(not recorded)",
         r.machine or "(not recorded)", "yes" if keeps_runs(r.data) else "no",
         r.label]
        for r in results
    ]  # fmt: skip
    out = [
        "## Every results file\n",
        "What each `bench/results/*.json` records of itself. *Standing*: `current` when no "
        "commit after the recorded one changed a path the bench measures (`MEASURES` in "
        "bench/report.py); `STALE` when one did, so the figures describe older code; "
        "`unbacked` when the recorded commit is not in the history or none is recorded; "
        "`+local` when the tree had uncommitted changes, so the commit does not fully name "
        "the code measured.\n",
        table(
            [
                "file",
                "bench",
                "role",
                "command",
                "commit",
                "date",
                "machine",
                "per-run figures kept",
                "standing",
            ],
            rows,
        ),
    ]
    if md_only:
        out.append(
            "\nPages with no .json (printed figures, nothing a reader can check): "
            + ", ".join(f"`{s}.md`" for s in md_only)
            + "."
        )
    return "\n".join(out) + "\n"


def page(results: list[Result], md_only: list[str], as_of: str) -> str:
    by_stem = {r.stem: r for r in results}
    chosen = [r for r in results if r.stem in CHOSEN]
    stale = [r.stem for r in chosen if r.stale]
    unbacked = [r.stem for r in chosen if r.unbacked]
    local = [r.stem for r in chosen if r.local]
    missing = sorted(set(CHOSEN) - set(by_stem))
    summary = [
        f"- STALE ({len(stale)}): " + (", ".join(f"`{s}`" for s in stale) or "none"),
        f"- unbacked ({len(unbacked)}): " + (", ".join(f"`{s}`" for s in unbacked) or "none"),
        f"- measured on a tree with local changes ({len(local)}): "
        + (", ".join(f"`{s}`" for s in local) or "none"),
    ]
    if missing:
        summary.append("- chosen but missing: " + ", ".join(f"`{s}`" for s in missing))
    return "\n".join([
        "# Benchmarks\n",
        f"<!-- bench-report as-of: {as_of} -->\n",
        "Generated by `make bench-report` (bench/report.py) from `bench/results/*.json`: edit "
        "or re-measure those, not this page. Every bench saves its command, commit, machine and "
        f"date beside its figures; the standing of each file is checked against commit "
        f"`{as_of[:7]}`, when this page was made.\n",
        "## Headline\n",
        headline(by_stem, in_readme=False),
        "## Standing of the chosen files\n",
        *summary,
        "",
        compare_section(results),
        figures_section(results),
        files_section(results, md_only),
    ]).rstrip() + "\n"  # fmt: skip


# --- README ---------------------------------------------------------------------------------
def readme_with(text: str, block: str) -> str | None:
    """``text`` with ``block`` between the markers; None if it has not both, in order."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < 0 or end < start:
        return None
    return text[: start + len(START)] + "\n\n" + block.rstrip() + "\n\n" + text[end:]


def generate(
    results_dir: Path = RESULTS, as_of: str | None = None, git: Git = run_git
) -> tuple[str, str]:
    """(the page, the README block) as they are generated now."""
    if as_of is None:
        as_of = (git(["rev-parse", "HEAD"]) or "").strip()
    results = load(results_dir, as_of, git)
    by_stem = {r.stem: r for r in results}
    return page(results, markdown_only(results_dir), as_of), headline(by_stem)


def committed_as_of(path: Path | None = None) -> str | None:
    """The commit the committed page (``PAGE`` unless ``path``) checked its files against."""
    path = path or PAGE
    found = AS_OF.search(path.read_text()) if path.exists() else None
    return found.group(1) if found else None


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page or README differ")
    p.add_argument("--as-of", help="check staleness against this commit (default HEAD; with "
                   "--check, the commit the committed page names)")  # fmt: skip
    args = p.parse_args(argv)
    as_of = args.as_of or (committed_as_of() if args.check else None)
    if as_of is not None:
        as_of = (run_git(["rev-parse", as_of]) or as_of).strip()
    text, block = generate(as_of=as_of)
    readme = README.read_text()
    new_readme = readme_with(readme, block)
    if args.check:
        bad = [] if PAGE.exists() and PAGE.read_text() == text else [shown(PAGE)]
        if new_readme is not None and new_readme != readme:
            bad.append("README.md's bench-report block")
        for what in bad:
            print(f"{what} differs from its regeneration: run make bench-report", file=sys.stderr)
        return 1 if bad else 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {shown(PAGE)}")
    if new_readme is None:
        print(f"README.md has no {START} ... {END} markers: wrote the page only")
    elif new_readme != readme:
        README.write_text(new_readme)
        print("rewrote README.md's bench-report block")
    else:
        print("README.md's bench-report block already up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
