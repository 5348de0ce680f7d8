"""The locust harness (loadtest/) run against a real server, per scenario.

Each scenario goes through ``loadtest/run.sh`` exactly as a user runs it, and runs until its
CSV stats (rewritten every second) show each request kind the checks expect, enough times;
then it is stopped as a user stops it, with Ctrl-C (SIGINT to its process group), and the
checks read the statistics it saves. Not a fixed run time: on a loaded machine locust's start
and the pollers' start-up submit can take most of a short run. The scenarios run at the same
time (one locust process each) to keep the test's wall time near one run. The locustfile is
never imported here: importing locust monkey-patches the whole process with gevent.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from jobtier.engine.queue import Queue
from jobtier.worker.registry import TaskRegistry
from tests.fixtures.api import KEYS, ApiServer
from tests.fixtures.engine import Background, worker_for

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "loadtest" / "run.sh"
LOCUST = Path(sys.executable).parent / "locust"


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    out: Path

    def stats(self) -> dict[str, dict[str, str]]:
        """The final statistics, keyed by request name (the totals row is "Aggregated").

        Read from the JSON locust writes once everything has stopped (``--json-file``, passed
        by ``run_sh``): its CSV is a snapshot rewritten every second while the run goes on,
        so the last second of a short run may be missing from it.
        """
        rows = json.loads((self.out / "final.json").read_text())
        stats = {
            r["name"]: {
                "Request Count": str(r["num_requests"]),
                "Failure Count": str(r["num_failures"]),
                "Min Response Time": str(r["min_response_time"]),
            }
            for r in rows
        }
        stats["Aggregated"] = {
            "Request Count": str(sum(r["num_requests"] for r in rows)),
            "Failure Count": str(sum(r["num_failures"] for r in rows)),
        }
        assert (self.out / "stats_stats.csv").stat().st_size > 0  # the CSV report is there too
        return stats

    def explain(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBTIER_", "LOADTEST_"))}
    env.update(LOCUST=str(LOCUST), LOADTEST_WAIT="0.01")
    return env


async def run_sh(
    args: list[str],
    env: dict[str, str],
    out: Path,
    *,
    until: Callable[[Path], bool] | None = None,
    timeout: float = 180.0,
) -> Run:
    """Run loadtest/run.sh to its end, or (``until``) until ``until(out)`` holds, then stop it
    with Ctrl-C. ``timeout`` bounds a broken or hung run (not a timing assertion)."""
    proc = await asyncio.create_subprocess_exec(
        "bash", str(RUN_SH), *args, "--out", str(out), "--", "--json-file", str(out / "final"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own process group: run.sh and locust, for the signals
    )  # fmt: skip
    output = asyncio.ensure_future(proc.communicate())
    try:
        async with asyncio.timeout(timeout):
            if until is not None:
                while not output.done() and not until(out):
                    await asyncio.wait({output}, timeout=0.25)
                if not output.done():
                    # as Ctrl-C in a terminal: locust stops its users, prints its tallies and
                    # writes its reports; run.sh goes on to its last line
                    os.killpg(proc.pid, signal.SIGINT)
            stdout, stderr = await output
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await output
        raise
    assert proc.returncode is not None
    return Run(proc.returncode, stdout.decode(), stderr.decode(), out)


def request_counts(out: Path) -> dict[str, int]:
    """Requests per name so far, from the CSV locust rewrites every second ({} before the
    first write; a row caught half-written counts when it is next read whole)."""
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError), (out / "stats_stats.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                counts[row["Name"]] = int(row["Request Count"])
    return counts


def seen(minimums: Mapping[str, int]) -> Callable[[Path], bool]:
    """``until`` for ``run_sh``: each name has made at least its number of requests."""

    def check(out: Path) -> bool:
        counts = request_counts(out)
        return all(counts.get(name, 0) >= n for name, n in minimums.items())

    return check


def requested(run: Run, *names: str) -> dict[str, dict[str, str]]:
    """Check that each name made requests and that nothing anywhere failed."""
    stats = run.stats()
    assert run.code == 0, run.explain()
    for name in names:
        assert name in stats, f"no {name!r} in {sorted(stats)}\n{run.explain()}"
        assert int(stats[name]["Request Count"]) > 0, name
    for name, row in stats.items():
        assert row["Failure Count"] == "0", f"{name}: {row['Failure Count']} failures"
    assert int(stats["Aggregated"]["Request Count"]) > 0
    assert (run.out / "report.html").stat().st_size > 0
    assert "scenario:" in (run.out / "run.txt").read_text()
    return stats


POLLER = ("GET /v1/jobs/[id] hot", "GET /v1/jobs/[id] spread")
SUBMITTER = ("POST /v1/jobs", "POST /v1/jobs idempotency-key", "POST /v1/jobs duplicate")
WATCHER = (
    "POST /v1/jobs watched",
    "GET /v1/jobs/[id]/events",
    "events: first",
    "events: stream",
    "events: count",
)
MIN = 10  # requests of each expected kind before a run is stopped


async def test_every_scenario_runs_without_failures(
    api: ApiServer, queue: Queue, background: Background, tmp_path: Path
) -> None:
    background.start(worker_for(queue, TaskRegistry.load("jobtier.demo"), concurrency=50))
    # jobs made beforehand, for the poller run that reads its ids from a file
    async with api.client() as c:
        r = await c.post("/v1/jobs/batch", json={"jobs": [{"type": "echo"}] * 20})
        ids = [result["job"]["id"] for result in r.json()["results"]]
    jobs_file = tmp_path / "jobs.txt"
    jobs_file.write_text("\n".join(ids) + "\n")

    # -t is only locust's own bound: each run is stopped once it has made every kind of
    # request its checks expect, MIN times (a hundred hot reads over five pollers: each
    # poller reads a hot job again, with the ETag it holds)
    common = ["--url", api.url, "--key", KEYS["acme"], "-u", "5", "-r", "5", "-t", "10m"]
    env = base_env()
    scenarios = {
        "poller": (
            ["-s", "poller"],
            {"LOADTEST_HOT_JOBS": "3", "LOADTEST_SPREAD_JOBS": "50"},
            {POLLER[0]: 100, POLLER[1]: MIN},
        ),
        "poller-file": (
            ["-s", "poller"],
            {"LOADTEST_JOBS_FILE": str(jobs_file)},
            dict.fromkeys(POLLER, MIN),
        ),
        "submitter": (
            ["-s", "submitter"],
            {"LOADTEST_IDEMPOTENCY": "0.3", "LOADTEST_DUPLICATES": "0.3"},
            dict.fromkeys(SUBMITTER, MIN),
        ),
        "watcher": (
            ["-s", "watcher"],
            {"LOADTEST_WATCH_PAYLOAD": '{"seconds": 0.3}'},
            dict.fromkeys(WATCHER, MIN),
        ),
        "mixed": (
            ["-s", "mixed"],
            {
                "LOADTEST_WEIGHTS": "poller=1,submitter=1,watcher=1",
                "LOADTEST_SPREAD_JOBS": "20",
                "LOADTEST_WATCH_PAYLOAD": '{"seconds": 0.2}',
            },
            dict.fromkeys([POLLER[0], SUBMITTER[0], *WATCHER], MIN),
        ),
    }
    runs = dict(
        zip(
            scenarios,
            await asyncio.gather(
                *(
                    run_sh(common + args, {**env, **extra}, tmp_path / name, until=seen(wanted))
                    for name, (args, extra, wanted) in scenarios.items()
                )
            ),
            strict=True,
        )
    )

    run = runs["poller"]
    requested(run, *POLLER)
    assert "submitted 53 jobs for the pollers" in run.stdout, run.explain()
    # the pollers send the ETag they saw: most reads of unchanged jobs are 304s
    reads, not_modified = _status_reads(run.stdout)
    assert reads > 0 and not_modified > 0, run.stdout

    run = runs["poller-file"]
    stats = requested(run, *POLLER)
    assert "submitted" not in run.stdout  # it read the given ids, made none
    # 20 given ids, 5 hot: the default hot count applies to a given list too
    assert int(stats["GET /v1/jobs/[id] hot"]["Request Count"]) > 0

    requested(runs["submitter"], *SUBMITTER)

    run = runs["watcher"]
    stats = requested(run, *WATCHER)
    # every stream had at least the first status and the terminal one
    assert float(stats["events: count"]["Min Response Time"]) >= 2, stats["events: count"]
    assert "SSE streams completed" in run.stdout

    requested(runs["mixed"], POLLER[0], SUBMITTER[0], *WATCHER)


def _status_reads(stdout: str) -> tuple[int, int]:
    for line in stdout.splitlines():
        if line.startswith("loadtest: status reads"):
            words = line.replace(",", "").split()
            return int(words[3]), int(words[7])
    raise AssertionError(f"no status-read tally in:\n{stdout}")


async def test_refuses_a_remote_target_unless_allowed(tmp_path: Path) -> None:
    env = base_env()
    args = ["--url", "http://192.0.2.1:8000", "--key", "k", "-u", "1", "-t", "1s"]
    run = await run_sh(args, env, tmp_path / "refused")
    assert run.code != 0 and "refusing to load http://192.0.2.1:8000" in run.stderr, run.explain()


async def test_run_sh_checks_its_arguments(tmp_path: Path) -> None:
    env = base_env()
    for args, message in (
        (["--users", "many", "--key", "k"], "--users must be a positive integer"),
        (["--run-time", "forever", "--key", "k"], "--run-time must look like"),
        (["--scenario", "stampede", "--key", "k"], "unknown scenario stampede"),
        ([], "no API key"),
    ):
        run = await run_sh(args, env, tmp_path / "args")
        assert run.code == 2 and message in run.stderr, run.explain()
    run = await run_sh(["--help"], env, tmp_path / "help")
    assert run.code == 0 and "--scenario" in run.stdout and "LOADTEST_" in run.stdout


def test_locustfile_documents_every_variable_it_reads() -> None:
    source = (ROOT / "loadtest" / "locustfile.py").read_text()
    _, doc, code = source.split('"""', 2)
    read = set(re.findall(r"\"((?:LOADTEST|JOBTIER)_[A-Z_]+)\"", code))
    assert read >= {"JOBTIER_URL", "JOBTIER_KEY", "LOADTEST_HOT_RATIO", "LOADTEST_WEIGHTS"}, read
    missing = sorted(name for name in read if name not in doc)
    assert not missing, f"read but not documented at the top of the locustfile: {missing}"
