"""Benchmark: ``GET /v1/jobs/{id}`` over HTTP, jobtier's read path against a plain baseline.

Starts its own Redis (AOF on, ``noeviction``) and ``jobtier api`` server processes, fills
``--jobs`` jobs (4 tenants: 60% succeeded, 40% scheduled a month ahead), then, for each
server configuration and in each of ``--runs`` runs (figures are medians):

mixes
  hot     every request on 5 jobs;
  spread  uniform over all the filled jobs;
  churn   80% on 5 jobs that report progress every 50 ms (a new version about every 0.2 s),
          10% on 2,500+ jobs that a background worker moves queued -> running -> progress
          -> succeeded during the run, 10% spread; a probe meanwhile compares the version
          the API serves with the one in Redis (a stale read must not outlive an event).
load modes
  closed  wrk, 50 connections, 1 thread: throughput at saturation; its latency is measured
          from each send, so it hides queueing (coordinated omission);
  open10k / open20k
          ``openloop.c`` (ours, compiled with gcc): requests *scheduled* at a fixed rate on
          200 keep-alive connections, latency from the intended send time; requests never
          sent or answered count as infinitely slow.
configurations
  jobtier        as built: near cache + singleflight/coalescing, the status fast path
                 (``status.fastpath.StatusFastPath``) answering status reads ahead of the
                 router, granian, gc.freeze;
  jobtier-before the same at the git revision of ``--before REV`` (its ``src`` first on the
                 server's PYTHONPATH), interleaved with the others in each run;
  jobtier-routed the same with the fast path turned off (``create_app(...,
                 status_fast_path=False)``, through the ``sitecustomize`` below): every read
                 goes through Starlette's router and request objects;
  baseline       JOBTIER_NEAR_CACHE=0 JOBTIER_COALESCE=0: one Redis call per request (an
                 HMGET before job format 3; since, read_status.lua for one job, which renders
                 the document of a job in format 3);
  *-uvicorn      the same under uvicorn (server choice);
  gc-nofreeze / gc-thresholds
                 JOBTIER_GC_FREEZE=0, or gc.freeze plus raised thresholds (set through a
                 ``sitecustomize`` the bench writes; there is no setting for it);
  jobtier-2w     two server processes, not pinned.
Every server process also logs what its cyclic garbage collector did (gc.callbacks), so each
cell reports the collections and pauses that happened while it ran. Then a memory run (RSS
of the serving process over ``--memory-seconds`` at 10K req/s, churn mix, per GC setting)
and the submit figures (``POST /v1/jobs`` open loop at 1K and 2K/s, closed c50;
``POST /v1/jobs/batch`` of 1,000 jobs, closed c4). There is no Postgres: reads of jobs that
Redis holds never need it (the server's Postgres probes fail fast on a closed port).

Placement: the API server is pinned to CPU 0 (``taskset``); this process, Redis, the load
generators and the churn worker to CPU 1: the server gets one core of its own.
(Not pinning the server was no better in a side run: p99 at 10K req/s 2.9 ms against 1.8
on hot keys, 90 against 123 ms on spread keys, both within this machine's noise.)

    .venv/bin/python bench/status_read.py                  # everything, 3 runs (~50 min)
    .venv/bin/python bench/status_read.py --quick          # 1 run, short cells: smoke test
    .venv/bin/python bench/status_read.py --configs jobtier,baseline --mixes hot
    .venv/bin/python bench/status_read.py --quick --runs 3 --configs jobtier --phases read \
        --before main                                     # this tree against main

Results: bench/results/status_read.json and .md (status_read-quick.* for --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    baseline_tree,
    drop_ready,
    environment,
    header_markdown,
    local_redis,
    median,
    save,
    table,
)
from common import fmt as _fmt
from common_http import (
    HOT,
    REQUESTS_PER_FILE,
    SHARDS,
    TENANTS,
    ApiProcess,
    Counters,
    ReplayProbe,
    StalenessProbe,
    build_openloop,
    churn,
    churn_requests,
    fill,
    get_json,
    get_requests,
    http_request,
    make_dead,
    run_openloop,
    run_wrk,
    write_requests,
)

from jobtier.core.keys import Keys
from jobtier.dev.local_redis import free_port

SERVER_CPUS, LOAD_CPUS = "0", "1"
ADMIN = "bench-admin-key"
GC_THRESHOLDS = "50000,50,100"
TARGET_RPS, TARGET_P99_MS, TARGET_HOT_FACTOR = 10_000, 10.0, 50

ALL_MIXES, ALL_MODES, SHORT_MODES = (
    ("hot", "spread", "churn"),
    ("closed", "open10k", "open20k"),
    ("closed", "open10k"),
)
BASELINE = {"JOBTIER_NEAR_CACHE": "0", "JOBTIER_COALESCE": "0"}
BEFORE = "jobtier-before"  # jobtier at --before REV


@dataclass(frozen=True)
class Config:
    server: str
    env: dict[str, str]
    mixes: tuple[str, ...] = ALL_MIXES
    modes: tuple[str, ...] = ALL_MODES
    cpus: str = SERVER_CPUS
    note: str = ""


CONFIGS = {
    "jobtier": Config(
        "granian", {}, note="as built: near cache + coalescing + fast path, gc.freeze"
    ),
    BEFORE: Config("granian", {}, note="as built, at the git revision of --before"),
    "jobtier-routed": Config(
        "granian", {"BENCH_ROUTED": "1"}, note="without the status fast path (see below)"
    ),
    "baseline": Config("granian", BASELINE, note="one Redis call per request"),
    "jobtier-final2s": Config(
        "granian", {"JOBTIER_NEAR_CACHE_FINAL_TTL": "2"}, ALL_MIXES, ("closed", "open20k"),
        note="terminal documents kept 2 s like the others (the near cache before final_ttl)",
    ),
    "jobtier-uvicorn": Config("uvicorn", {}, modes=SHORT_MODES),
    "baseline-uvicorn": Config("uvicorn", BASELINE, ALL_MIXES[:2], ("closed",)),
    "gc-nofreeze": Config("granian", {"JOBTIER_GC_FREEZE": "0"}, ALL_MIXES[:2], SHORT_MODES),
    "gc-thresholds": Config(
        "granian", {"BENCH_GC_THRESHOLD": GC_THRESHOLDS}, ALL_MIXES[:2], SHORT_MODES,
        note=f"gc.freeze + gc.set_threshold({GC_THRESHOLDS})",
    ),
    "jobtier-2w": Config(
        "granian", {"JOBTIER_API_WORKERS": "2"}, ALL_MIXES[:2],
        ("closed", "open20k"), cpus="0,1", note="2 server processes, not pinned",
    ),
}  # fmt: skip
RATES = {"open10k": 10_000, "open20k": 20_000}
# Loaded by every server process the bench starts (PYTHONPATH): settings jobtier has no
# switch for (yet), applied before the app is built.
SITECUSTOMIZE = """\
import gc, os, sys, threading, time
_t = os.environ.get("BENCH_GC_THRESHOLD")
if _t:
    gc.set_threshold(*(int(x) for x in _t.split(",")))
if os.environ.get("BENCH_ROUTED"):
    import jobtier.api.app as _app
    _create = _app.create_app

    def create_app(*args, **kwargs):
        return _create(*args, **kwargs, status_fast_path=False)

    _app.create_app = create_app

# the cyclic collector's work in this process: collections and pause time per generation,
# cumulative, and the longest pause since the previous line; one line a second on stderr
_gc = {"n": [0, 0, 0], "ms": [0.0, 0.0, 0.0], "max": 0.0, "t": 0.0}


def _on_gc(phase, info):
    if phase == "start":
        _gc["t"] = time.perf_counter()
        return
    ms = (time.perf_counter() - _gc["t"]) * 1e3
    g = info["generation"]
    _gc["n"][g] += 1
    _gc["ms"][g] += ms
    _gc["max"] = max(_gc["max"], ms)


def _report():
    while True:
        time.sleep(1)
        n, ms = _gc["n"], _gc["ms"]
        print("GCSTATS %d %d %d %d %.3f %.3f %.3f %.3f" % (os.getpid(), *n, *ms, _gc["max"]),
              file=sys.stderr, flush=True)
        _gc["max"] = 0.0


def _start_reporter():
    threading.Thread(target=_report, daemon=True).start()


gc.callbacks.append(_on_gc)
_start_reporter()
# granian forks its workers: a thread does not survive a fork, so each child starts its own
# (without this only the supervisor reported, and the serving process's collections were
# never seen)
os.register_at_fork(after_in_child=_start_reporter)
"""


# --- one measured cell ------------------------------------------------------------------------
def reader_stats(api: ApiProcess) -> dict[str, float]:
    """The status reader's counters (one server process: with several, only the one that
    answered)."""
    stats: dict[str, float] = get_json(api.url + "/v1/admin/stats", ADMIN)["status_reads"]
    return stats


def measure(
    api: ApiProcess,
    r: redis.Redis,
    mode: str,
    reqfile: Path,
    args: argparse.Namespace,
    tmp: Path,
    openloop: Path,
) -> dict[str, Any]:
    if mode == "closed":  # wrk has no warm-up of its own
        run_wrk(api.port, reqfile, 2, connections=50, cpus=LOAD_CPUS, script_dir=tmp)
    reads0 = reader_stats(api)
    gc0 = gc_lines(api)
    counters = Counters(api, r)
    if mode == "closed":
        load = run_wrk(
            api.port, reqfile, args.duration, connections=50, cpus=LOAD_CPUS, script_dir=tmp
        )
    else:
        load = run_openloop(
            openloop, api.port, reqfile, RATES[mode], args.duration, warmup=2.0, cpus=LOAD_CPUS
        )
    # per request = per response the generator saw (the openloop count includes its warm-up,
    # which ran between the snapshots too; the few probe requests are left out)
    out = counters.done(load["responses"])
    time.sleep(1.1)  # one more GCSTATS line, covering the end of the run
    out["gc"] = gc_delta(gc0, gc_lines(api))
    reads1 = reader_stats(api)
    rd = {
        k: reads1.get(k, 0) - reads0.get(k, 0)
        for k in ("requests", "near_hits", "redis_loads", "batches", "script_calls")
    }
    per = max(rd["requests"], 1)
    out.update(
        load=load,
        reader=rd,
        # what the API sent Redis: on one server every batch is one command (an HMGET, or
        # one read_status.lua call that reads many hashes)
        sent_cmds_per_req=rd["batches"] / per,
        hash_reads_per_req=rd["redis_loads"] / per,
        near_hit_ratio=rd["near_hits"] / per,
    )
    return out


def gc_lines(api: ApiProcess) -> list[list[float]]:
    """Every GCSTATS line the server processes have logged so far (see SITECUSTOMIZE)."""
    if api.log is None or not api.log.exists():
        return []
    out = []
    for line in api.log.read_text(errors="replace").splitlines():
        if line.startswith("GCSTATS "):
            try:
                row = [float(x) for x in line.split()[1:]]
            except ValueError:
                row = []
            # two server processes share the log: a line torn by the other's write is
            # skipped (the counters are cumulative: the next line carries them)
            if len(row) == 8:
                out.append(row)
    return out


def gc_delta(before: list[list[float]], after: list[list[float]]) -> dict[str, float]:
    """Collections per generation, their total pause, and the longest pause during a cell
    (summed over the server's processes)."""
    last0: dict[float, list[float]] = {}
    for row in before:
        last0[row[0]] = row
    last1: dict[float, list[float]] = {}
    longest = 0.0
    for row in after[len(before) :]:
        last1[row[0]] = row
        longest = max(longest, row[7])
    n = [0.0, 0.0, 0.0]
    ms = 0.0
    for pid, row in last1.items():
        base = last0.get(pid, [pid, 0, 0, 0, 0.0, 0.0, 0.0, 0.0])
        for g in range(3):
            n[g] += row[1 + g] - base[1 + g]
            ms += row[4 + g] - base[4 + g]
    return {"gen0": n[0], "gen1": n[1], "gen2": n[2], "pause_ms": ms, "longest_ms": longest}


def summary_row(result: dict[str, Any]) -> dict[str, Any]:
    load = result["load"]
    lat = load["latency_ms"]
    if load["generator"] == "wrk":
        errors = sum(load["errors"].values()) + load["non_2xx_3xx"]
    else:
        s = load["status"]
        errors = (
            load["errors"]["connect"]
            + load["errors"]["io"]
            + s["4xx"]
            + s["5xx"]
            + s["other"]
            + load["unsent"]
            + load["unanswered"]
        )
    return {
        "rps": load["achieved_rps"],
        "p50": lat["p50"],
        "p99": lat["p99"],
        "p99.9": lat["p99.9"],
        "errors": errors,
        "redis_cmds_per_req": result["redis_cmds_per_req"],
        "sent_cmds_per_req": result["sent_cmds_per_req"],
        "hash_reads_per_req": result["hash_reads_per_req"],
        "near_hit_ratio": result["near_hit_ratio"],
        "server_cpu_us_per_req": result["server_cpu_us_per_req"],
        "server_cpu_share": result["server_cpu_share"],
        "cpu0_busy": result["cpu_busy"][0] if result["cpu_busy"] else None,
        "gc_collections": sum(result["gc"][f"gen{g}"] for g in range(3)),
        "gc_pause_ms": result["gc"]["pause_ms"],
        "gc_longest_ms": result["gc"]["longest_ms"],
        "stale": result.get("staleness", {}).get("stale_after_100ms"),
        "probes": result.get("staleness", {}).get("probes"),
        "replays_stale": result.get("staleness", {}).get("replays_stale"),
        "replays": result.get("staleness", {}).get("replays"),
    }


# --- phases -----------------------------------------------------------------------------------
def server_env(url: str, port: int, extra: dict[str, str], site: Path) -> dict[str, str]:
    return {
        "JOBTIER_REDIS_URL": url,
        "JOBTIER_SHARDS": str(SHARDS),
        "JOBTIER_API_KEYS": ",".join(f"{k}:{t}" for k, t in TENANTS.items()),
        "JOBTIER_ADMIN_KEY": ADMIN,
        "JOBTIER_API_WORKERS": "1",
        "JOBTIER_API_PORT": str(port),
        "JOBTIER_LOG_LEVEL": "WARNING",
        "BENCH_GC_LOG": "1",
        # no Postgres in this bench: status reads of jobs Redis holds never need it; the
        # closed port makes its probes (readiness, write-behind lag) fail fast
        "JOBTIER_DATABASE_URL": "postgresql://jobtier@127.0.0.1:9/jobtier",
        # BENCH_SRC: another revision's code (--before), ahead of this tree's
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), extra.get("BENCH_SRC")])),
        **extra,
    }


def start_api(
    name: str, url: str, site: Path, tmp: Path, extra: dict[str, str] | None = None
) -> ApiProcess:
    c = CONFIGS[name]
    port = free_port()
    env = server_env(url, port, {**c.env, **(extra or {})}, site)
    return ApiProcess(
        port, env, server=c.server, cpus=c.cpus, log=tmp / f"api-{name}.log"
    ).wait_ready()


def read_runs(
    args: argparse.Namespace,
    url: str,
    fill_ids: list[tuple[str, str]],
    tmp: Path,
    site: Path,
    openloop: Path,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    r = redis.Redis.from_url(url)
    rows: list[dict[str, Any]] = []
    hot_ids = random.Random(1).sample(fill_ids, HOT)
    for run in range(args.runs):
        # each run starts with the next config: none always takes the first (coldest) turn
        turn = run % len(args.configs)
        for name in args.configs[turn:] + args.configs[:turn]:
            c = CONFIGS[name]
            api = start_api(name, url, site, tmp)
            try:
                for mix in [m for m in c.mixes if m in args.mixes]:
                    for mode in [m for m in c.modes if m in args.modes]:
                        rows.append(
                            read_cell(
                                args,
                                url,
                                r,
                                api,
                                name,
                                run,
                                mix,
                                mode,
                                fill_ids,
                                hot_ids,
                                tmp,
                                openloop,
                                log,
                            )
                        )
            finally:
                api.stop()
    r.close()
    return rows


def read_cell(
    args: argparse.Namespace,
    url: str,
    r: redis.Redis,
    api: ApiProcess,
    name: str,
    run: int,
    mix: str,
    mode: str,
    fill_ids: list[tuple[str, str]],
    hot_ids: list[tuple[str, str]],
    tmp: Path,
    openloop: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:
    file = tmp / f"req-{mix}-{api.port}.bin"
    if mix == "hot":
        write_requests(file, get_requests(hot_ids, 20_000, 3, api.port))
        result = measure(api, r, mode, file, args, tmp, openloop)
    elif mix == "spread":
        write_requests(file, get_requests(fill_ids, REQUESTS_PER_FILE, 5, api.port))
        result = measure(api, r, mode, file, args, tmp, openloop)
    else:
        seconds = args.duration + 8
        dead = asyncio.run(make_dead(url, int(20 * seconds)))  # replayed 20 a second
        with churn(url, seconds, steps=int(60 * seconds)) as (churn_hot, churn_steps):
            write_requests(file, churn_requests(churn_hot, churn_steps, fill_ids, api.port))
            probe = StalenessProbe(url, api.port, churn_hot + churn_steps[:200])
            replays = ReplayProbe(url, api.port, dead)
            probe.start()
            replays.start()
            try:
                result = measure(api, r, mode, file, args, tmp, openloop)
            finally:
                probe.stop_flag.set()
                replays.stop_flag.set()
                probe.join()
                replays.join()
            result["staleness"] = {
                "probes": probe.probes,
                "lagging": probe.lagging,
                "stale_after_100ms": probe.stale,
                "errors": probe.errors,
                "replays": replays.replays,
                "replays_stale": replays.stale,
                "replay_errors": replays.errors,
            }
    s = summary_row(result)
    stale = (
        f"  stale {result['staleness']['stale_after_100ms']}/{result['staleness']['probes']}"
        f"  replays stale {result['staleness']['replays_stale']}/"
        f"{result['staleness']['replays']}"
        if mix == "churn"
        else ""
    )
    log(
        f"run {run + 1} {name:17} {mix:6} {mode:7} {fmt(s['rps'])} req/s  p50 {fmt(s['p50'], 2)}  p99 {fmt(s['p99'], 2)}  "
        f"p99.9 {fmt(s['p99.9'], 2)} ms  errors {s['errors']}  cmds/req {s['redis_cmds_per_req']:.3f} sent/req "
        f"{s['sent_cmds_per_req']:.4f}  cpu {s['server_cpu_us_per_req']:.0f} us/req (server {s['server_cpu_share']:.0%} "
        f"of a core, cpu0 busy {fmt(s['cpu0_busy'], 2)}){stale}"
    )
    return {"run": run, "config": name, "server": api.server, "mix": mix, "mode": mode, **result}


def memory_runs(
    args: argparse.Namespace,
    url: str,
    fill_ids: list[tuple[str, str]],
    tmp: Path,
    site: Path,
    openloop: Path,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """RSS of the serving process over a long open-loop run at 10K req/s, per GC setting."""
    out = []
    for name in ("jobtier", "gc-nofreeze", "gc-thresholds"):
        api = start_api(name, url, site, tmp)
        try:
            spread = write_requests(
                tmp / "mem-spread.bin", get_requests(fill_ids, REQUESTS_PER_FILE, 11, api.port)
            )
            rss_start = api.rss_kb() / 1024
            # fill the near cache first (every id), so what grows afterwards is not the cache
            run_openloop(
                openloop, api.port, spread, 10_000, args.memory_warm, warmup=0, cpus=LOAD_CPUS
            )
            seconds = args.memory_seconds
            samples: list[tuple[float, float]] = []
            with churn(url, seconds + 4, steps=int(60 * (seconds + 4))) as (churn_hot, churn_steps):
                file = write_requests(
                    tmp / "mem-churn.bin",
                    churn_requests(churn_hot, churn_steps, fill_ids, api.port),
                )
                done = threading.Event()
                sampler = threading.Thread(
                    target=sample_rss, args=(api, samples, done), daemon=True
                )
                rss_warm = api.rss_kb() / 1024
                sampler.start()
                load = run_openloop(
                    openloop, api.port, file, 10_000, seconds, warmup=0, cpus=LOAD_CPUS
                )
                done.set()
                sampler.join()
            rss_end = api.rss_kb() / 1024
            half = [mb for t, mb in samples if t >= seconds / 2]
            row = {
                "config": name,
                "rss_mb_start": rss_start,
                "rss_mb_after_warm": rss_warm,
                "rss_mb_end": rss_end,
                "growth_mb": rss_end - rss_warm,
                "growth_second_half_mb": (half[-1] - half[0]) if len(half) > 1 else None,
                "samples": samples,
                "requests": load["responses"],
                "p99_ms": load["latency_ms"]["p99"],
                "p99.9_ms": load["latency_ms"]["p99.9"],
                "rps": load["achieved_rps"],
            }
            out.append(row)
            log(
                f"memory {name:14} RSS start {rss_start:.1f} MB, after warm-up {rss_warm:.1f}, end {rss_end:.1f} "
                f"(+{row['growth_mb']:.1f}) p99 {fmt(row['p99_ms'], 2)} ms"
            )
        finally:
            api.stop()
    return out


def sample_rss(api: ApiProcess, samples: list[tuple[float, float]], done: threading.Event) -> None:
    """(thread) (seconds, RSS MB) of the serving process every 5 s until ``done``."""
    t0 = time.monotonic()
    while not done.wait(5):
        samples.append((round(time.monotonic() - t0, 1), round(api.rss_kb() / 1024, 1)))


def submit_runs(
    args: argparse.Namespace,
    url: str,
    tmp: Path,
    site: Path,
    openloop: Path,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """POST /v1/jobs (open loop at 1K and 2K/s, closed c50) and POST /v1/jobs/batch (c4)."""
    rows = []
    keys = list(TENANTS)
    body = json.dumps(
        {"jobs": [{"type": "bench.noop", "payload": {"n": i}} for i in range(1000)]}
    ).encode()
    for run in range(args.runs):
        api = start_api("jobtier", url, site, tmp)
        try:
            single = write_requests(
                tmp / "submit.bin",
                (
                    http_request(
                        "POST",
                        "/v1/jobs",
                        keys[i % 4],
                        b'{"type":"bench.noop","payload":{"n":%d}}' % i,
                        port=api.port,
                    )
                    for i in range(20_000)
                ),
            )
            batch = write_requests(
                tmp / "batch.bin",
                (
                    http_request("POST", "/v1/jobs/batch", keys[i % 4], body, port=api.port)
                    for i in range(8)
                ),
            )
            for mode in ("open1k", "open2k", "closed", "batch"):
                if mode.startswith("open"):
                    rate = 1000 * int(mode[4])
                    load = run_openloop(
                        openloop, api.port, single, rate, args.duration, cpus=LOAD_CPUS
                    )
                else:
                    file, conns = (batch, 4) if mode == "batch" else (single, 50)
                    load = run_wrk(
                        api.port,
                        file,
                        args.duration,
                        connections=conns,
                        cpus=LOAD_CPUS,
                        script_dir=tmp,
                    )
                jobs_per_s = load["achieved_rps"] * (1000 if mode == "batch" else 1)
                rows.append({"run": run, "mode": mode, "load": load, "jobs_per_s": jobs_per_s})
                lat = load["latency_ms"]
                errors = (
                    load.get("non_2xx_3xx", 0)
                    if load["generator"] == "wrk"
                    else load["status"]["4xx"] + load["status"]["5xx"]
                )
                log(
                    f"run {run + 1} submit {mode:7} {fmt(jobs_per_s)} jobs/s  p50 {fmt(lat['p50'], 2)}  p99 {fmt(lat['p99'], 2)}  "
                    f"p99.9 {fmt(lat['p99.9'], 2)} ms  non-2xx {errors}"
                )
        finally:
            api.stop()
        # each run adds ~100K queued jobs that nobody claims: keep Redis lean between runs
        with contextlib.closing(redis.Redis.from_url(url)) as r:
            drop_ready(r, Keys("jt", SHARDS))
    return rows


# --- summary ----------------------------------------------------------------------------------
def fmt(value: Any, digits: int = 0) -> str:
    return "-" if value is None else _fmt(value, digits)


def median_or_none(values: list[float | None]) -> float | None:
    """Median where None (a latency beyond every answered request) counts as +infinity."""
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    mid = ordered[len(ordered) // 2] if len(ordered) % 2 else None
    if len(ordered) % 2 == 0:
        a, b = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
        mid = None if a is None or b is None else (a + b) / 2
    return mid


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["config"], row["mix"], row["mode"]), []).append(summary_row(row))
    out: list[dict[str, Any]] = []
    for (config, mix, mode), items in groups.items():
        med = {k: median_or_none([i[k] for i in items]) for k in items[0]}
        for k in ("stale", "probes", "replays_stale", "replays"):  # totals over the runs
            med[k] = (
                sum(i[k] for i in items if i[k] is not None) if items[0][k] is not None else None
            )
        out.append({"config": config, "mix": mix, "mode": mode, "runs": len(items), **med})
    by_key = {(s["config"], s["mix"], s["mode"]): s for s in out}
    for s in out:
        if s["config"].startswith("baseline"):
            continue
        base = "baseline-uvicorn" if CONFIGS[s["config"]].server == "uvicorn" else "baseline"
        b = by_key.get((base, s["mix"], s["mode"]))
        if b is not None:
            s["rps_vs_baseline"] = s["rps"] / b["rps"] if b["rps"] else None
            s["cmds_reduction_vs_baseline"] = (
                b["redis_cmds_per_req"] / s["redis_cmds_per_req"]
                if s["redis_cmds_per_req"]
                else None
            )
            s["sent_reduction_vs_baseline"] = (
                b["sent_cmds_per_req"] / s["sent_cmds_per_req"] if s["sent_cmds_per_req"] else None
            )
    return out


def ratio(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}x"


def status_table(summary: list[dict[str, Any]], configs: list[str]) -> str:
    headers = [
        "mix", "mode", "config", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "errors", "cmds/req",
        "sent/req", "near hits", "cpu µs/req", "server core", "cpu0 busy", "rps x base",
        "cmds ÷ base", "sent ÷ base", "stale", "replays stale",
    ]  # fmt: skip
    order = {c: i for i, c in enumerate(CONFIGS)}
    mixes = {m: i for i, m in enumerate(ALL_MIXES)}
    modes = {m: i for i, m in enumerate(ALL_MODES)}
    rows = []
    chosen = [s for s in summary if s["config"] in configs]
    for s in sorted(chosen, key=lambda s: (mixes[s["mix"]], modes[s["mode"]], order[s["config"]])):
        rows.append([
            s["mix"], s["mode"], s["config"], fmt(s["rps"]), fmt(s["p50"], 2), fmt(s["p99"], 2),
            fmt(s["p99.9"], 2), fmt(s["errors"]), f"{s['redis_cmds_per_req']:.4f}",
            f"{s['sent_cmds_per_req']:.4f}", near_hits(s),
            fmt(s["server_cpu_us_per_req"], 1), f"{s['server_cpu_share']:.0%}",
            "-" if s["cpu0_busy"] is None else f"{s['cpu0_busy']:.0%}",
            ratio(s.get("rps_vs_baseline")), ratio(s.get("cmds_reduction_vs_baseline"), 0),
            ratio(s.get("sent_reduction_vs_baseline"), 0),
            "" if s["probes"] is None else f"{s['stale']}/{s['probes']}",
            "" if s.get("replays") is None else f"{s['replays_stale']}/{s['replays']}",
        ])  # fmt: skip
    return table(headers, rows)


def near_hits(s: dict[str, Any]) -> str:
    """The near-cache hit ratio; '-' with several server processes, where the stats route
    answers from whichever process took the request (see reader_stats)."""
    config = CONFIGS.get(s["config"])
    if config is not None and config.env.get("JOBTIER_API_WORKERS", "1") != "1":
        return "-"
    return f"{s['near_hit_ratio']:.1%}"


def targets(summary: list[dict[str, Any]], config: str) -> list[str]:
    """The issue's targets, checked against the medians of ``config``."""
    lines = []
    cells = {(s["mix"], s["mode"]): s for s in summary if s["config"] == config}
    for mix in ALL_MIXES:
        for mode, rate in (("open10k", 10_000), ("open20k", 20_000)):
            s = cells.get((mix, mode))
            if s is None:
                continue
            ok = (
                s["p99"] is not None
                and s["p99"] < TARGET_P99_MS
                and s["rps"] >= 0.98 * rate
                and not s["errors"]
            )
            lines.append(
                f"- {mix}, {rate:,} req/s offered: {fmt(s['rps'])} req/s answered, p99 {fmt(s['p99'], 2)} ms, "
                f"errors {fmt(s['errors'])} → {'met' if ok else 'MISSED'}"
                + ("" if rate == TARGET_RPS else " (the 'aim for 20K' figure)")
            )
    hot = cells.get(("hot", "closed"))
    if hot is not None and hot["redis_cmds_per_req"]:
        factor = 1 / hot["redis_cmds_per_req"]
        lines.append(
            f"- hot key, Redis commands: 1 per {factor:,.0f} requests → "
            f"{'met' if factor >= TARGET_HOT_FACTOR else 'MISSED'} (target: ≥{TARGET_HOT_FACTOR}x fewer)"
        )
    return lines


def render(
    summary: list[dict[str, Any]],
    memory: list[dict[str, Any]],
    submits: list[dict[str, Any]],
    args: argparse.Namespace,
    env: dict[str, Any],
) -> str:
    md = [
        header_markdown("Status reads over HTTP: jobtier against one Redis call per request", env)
    ]
    md.append(
        f"- settings: {args.jobs:,} jobs (60% succeeded, 40% scheduled), {SHARDS} shards, 4 tenants; "
        f"{args.runs} runs x {args.duration:g} s per cell, each column the median over runs; configurations "
        "interleaved within each run. API server pinned to CPU 0 (`taskset`), one process "
        "(JOBTIER_API_WORKERS=1), uvloop; Redis, the load generator, the churn worker and this program on "
        "CPU 1 (except `jobtier-2w`).\n"
        "- generators: `closed` = **wrk** c50 t1: throughput at saturation; its latency runs from each send, "
        "so it hides queueing (coordinated omission). `open10k`/`open20k` = **bench/openloop.c** (ours): "
        "requests scheduled at a fixed rate over 200 keep-alive connections, latency from the *intended* "
        "send time; a request never sent or answered counts as infinitely slow (`-`).\n"
        "- `cmds/req`: Redis INFO commandstats delta ÷ requests — commands run inside scripts count, so "
        "one read_status.lua call reading 20 hashes counts 23 (its TIME and GET of the shard's job format "
        "too); churn includes the churn worker's own commands. `sent/req`: commands the API sent (the "
        "reader's round trips: one read_status.lua call, for one job or many) ÷ requests. `cpu µs/req`: API server CPU; "
        "`server core`: its share of one core during the cell; `cpu0 busy`: the whole CPU 0 (the rest is "
        "other processes on this shared machine).\n"
    )
    notes = [
        f"- `{name}`: {c.server}; {c.note}"
        for name, c in CONFIGS.items()
        if c.note and name in args.configs
    ]
    if notes:
        md += ["Configurations:", "", *notes, ""]
    main_configs = [
        c for c in ("jobtier", BEFORE, "jobtier-routed", "baseline") if c in args.configs
    ]
    md += [
        "## Status reads: jobtier against the baseline",
        "",
        status_table(summary, main_configs),
        "",
    ]
    md += ["### Targets (jobtier as built)", "", *targets(summary, "jobtier"), ""]
    if BEFORE in args.configs:
        md += [
            f"## This tree against git revision {args.before} (`--before`)",
            "",
            "Medians over the runs; the change is this tree's figure against the revision's.",
            "",
            before_table(summary),
            "",
        ]
    if "jobtier-2w" in args.configs:
        md += [
            "## Two server processes (JOBTIER_API_WORKERS=2, not pinned)",
            "",
            "Both cores serve, and share them with Redis, the load generator and the churn worker. "
            "Near hits `-`: the reader's counters come from one of the two processes.",
            "",
            status_table(summary, ["jobtier", "jobtier-2w"]),
            "",
        ]
    if "jobtier-final2s" in args.configs:
        md += [
            "## Terminal documents kept 1 h against 2 s (JOBTIER_NEAR_CACHE_FINAL_TTL)",
            "",
            status_table(summary, ["jobtier", "jobtier-final2s"]),
            "",
        ]
    md += server_section(summary, args)
    md += gc_section(summary, memory, args)
    if submits:
        md += submit_section(submits)
    md += ["## The read path: what changed", "", CHANGES, ""]
    return "\n".join(md)


def before_table(summary: list[dict[str, Any]]) -> str:
    cells = {(s["config"], s["mix"], s["mode"]): s for s in summary}
    rows = []
    for mix in ALL_MIXES:
        for mode in ALL_MODES:
            now, then = cells.get(("jobtier", mix, mode)), cells.get((BEFORE, mix, mode))
            if now is None or then is None:
                continue
            row = [mix, mode]
            for key, digits in (("rps", 0), ("p50", 2), ("p99", 2), ("server_cpu_us_per_req", 1)):
                a, b = now[key], then[key]
                change = f"{a / b - 1:+.1%}" if a is not None and b else "-"
                row += [fmt(b, digits), fmt(a, digits), change]
            rows.append(row)
    headers = ["mix", "mode"]
    for what in ("req/s", "p50 ms", "p99 ms", "cpu µs/req"):
        headers += [f"{what} before", f"{what} now", "change"]
    return table(headers, rows)


def server_section(summary: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    pairs = [("jobtier", "jobtier-uvicorn"), ("baseline", "baseline-uvicorn")]
    cells = {(s["config"], s["mix"], s["mode"]): s for s in summary}
    rows = []
    score = {"granian": 0, "uvicorn": 0}
    for granian, uvicorn in pairs:
        for mix in ALL_MIXES:
            for mode in SHORT_MODES:
                g, u = cells.get((granian, mix, mode)), cells.get((uvicorn, mix, mode))
                if g is None or u is None:
                    continue
                # the better server: more req/s at saturation (closed), a lower p99 at a
                # fixed rate (open), and in both, less CPU per request
                if mode == "closed":
                    score["granian" if g["rps"] >= u["rps"] else "uvicorn"] += 1
                else:
                    gp, up = g["p99"] or float("inf"), u["p99"] or float("inf")
                    score["granian" if gp <= up else "uvicorn"] += 1
                g_cpu, u_cpu = g["server_cpu_us_per_req"], u["server_cpu_us_per_req"]
                score["granian" if g_cpu <= u_cpu else "uvicorn"] += 1
                rows.append([
                    granian, mix, mode, fmt(g["rps"]), fmt(u["rps"]), ratio(g["rps"] / u["rps"] if u["rps"] else None),
                    fmt(g["p99"], 2), fmt(u["p99"], 2), fmt(g["server_cpu_us_per_req"], 1), fmt(u["server_cpu_us_per_req"], 1),
                ])  # fmt: skip
    if not rows:
        return []
    choice = max(score, key=lambda k: score[k])
    return [
        "## Server: granian against uvicorn (one process, uvloop, same pinning)",
        "",
        table(
            [
                "config",
                "mix",
                "mode",
                "granian req/s",
                "uvicorn req/s",
                "granian ÷ uvicorn",
                "granian p99",
                "uvicorn p99",
                "granian cpu µs",
                "uvicorn cpu µs",
            ],
            rows,
        ),
        "",
        f"Choice by these figures: **{choice}** (comparisons won, of req/s at saturation, p99 at a fixed "
        f"rate and CPU per request: granian {score['granian']}, uvicorn {score['uvicorn']}).",
        "",
    ]


def gc_section(
    summary: list[dict[str, Any]], memory: list[dict[str, Any]], args: argparse.Namespace
) -> list[str]:
    out = []
    names = [c for c in ("gc-nofreeze", "jobtier", "gc-thresholds") if c in args.configs]
    if len(names) > 1:
        cells = {(s["config"], s["mix"], s["mode"]): s for s in summary}
        rows = []
        for mix in ALL_MIXES[:2]:
            for mode in SHORT_MODES:
                line = [mix, mode]
                for name in names:
                    s = cells.get((name, mix, mode))
                    line.append(
                        "-"
                        if s is None
                        else f"{fmt(s['rps'])} / {fmt(s['p99'], 2)} / {fmt(s['p99.9'], 2)} / {fmt(s['server_cpu_us_per_req'], 1)}"
                    )
                rows.append(line)
        out += [
            "## Garbage collector settings (req/s / p99 ms / p99.9 ms / cpu µs per request)",
            "",
            f"`gc-nofreeze` = JOBTIER_GC_FREEZE=0; `jobtier` = gc.freeze() after start-up (the default); "
            f"`gc-thresholds` = gc.freeze() and gc.set_threshold({GC_THRESHOLDS}).",
            "",
            table(["mix", "mode", *names], rows),
            "",
        ]
    activity = [s for s in summary if s["gc_collections"] is not None]
    if activity:
        # what the collector actually did while each cell ran (gc.callbacks in the server)
        by_config: dict[str, list[dict[str, Any]]] = {}
        for s in activity:
            by_config.setdefault(s["config"], []).append(s)
        out += [
            "### Collections while serving (gc.callbacks in the server process; medians over runs)",
            "",
            table(
                [
                    "config",
                    "cells",
                    "most collections in a cell",
                    "most pause in a cell ms",
                    "longest pause ms",
                ],
                [
                    [
                        name,
                        str(len(cells_)),
                        fmt(max(c["gc_collections"] for c in cells_)),
                        fmt(max(c["gc_pause_ms"] for c in cells_), 1),
                        fmt(max(c["gc_longest_ms"] for c in cells_), 2),
                    ]
                    for name, cells_ in by_config.items()
                ],
            ),
            "",
        ]
    if memory:
        out += [
            f"## Memory of the serving process ({args.memory_seconds:g} s at 10K req/s, churn mix, after "
            f"{args.memory_warm:g} s of spread reads that fill the near cache)",
            "",
            table(
                [
                    "config",
                    "RSS at start MB",
                    "after warm-up MB",
                    "at end MB",
                    "growth MB",
                    "growth in 2nd half MB",
                    "requests",
                    "p99 ms",
                    "p99.9 ms",
                ],
                [
                    [
                        m["config"],
                        fmt(m["rss_mb_start"], 1),
                        fmt(m["rss_mb_after_warm"], 1),
                        fmt(m["rss_mb_end"], 1),
                        fmt(m["growth_mb"], 1),
                        fmt(m["growth_second_half_mb"], 1),
                        fmt(m["requests"]),
                        fmt(m["p99_ms"], 2),
                        fmt(m["p99.9_ms"], 2),
                    ]
                    for m in memory
                ],
            ),
            "",
        ]
    return out


def submit_section(submits: list[dict[str, Any]]) -> list[str]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in submits:
        groups.setdefault(row["mode"], []).append(row)
    names = {
        "open1k": "POST /v1/jobs, open loop 1,000/s",
        "open2k": "POST /v1/jobs, open loop 2,000/s",
        "closed": "POST /v1/jobs, wrk c50",
        "batch": "POST /v1/jobs/batch (1,000 jobs each), wrk c4",
    }
    rows = []
    for mode, items in groups.items():
        lat = [i["load"]["latency_ms"] for i in items]
        rows.append([
            names[mode], fmt(median([i["jobs_per_s"] for i in items])),
            *(fmt(median_or_none([x[k] for x in lat]), 2) for k in ("p50", "p99", "p99.9")),
        ])  # fmt: skip
    return [
        "## Submits (jobtier as built; target: p99 < 10 ms)",
        "",
        table(["what", "jobs/s", "p50 ms", "p99 ms", "p99.9 ms"], rows),
        "",
    ]


CHANGES = """\
Four changes, each measured before and after (1-3: 2026-11-29, 4: 2026-11-30, this machine):

1. Coalesced misses read their batch with one call of the read-only `store/lua/read_status.lua`
   (HMGET of every hash inside Redis; per shard on a cluster) instead of a pipeline of
   HMGETs. Client CPU per id (redis-py 8.1 + hiredis): 20 ids a batch 15.6 → 5.0 µs, 100 ids
   12.7 → 2.3 µs. The API sends one command per batch; INFO commandstats still counts each
   HMGET run inside the script, hence `cmds/req` near `hashes/req` on spread keys while
   `sent/req` is ~0.04.
2. `get_job` reads its two headers in one pass from the scope and answers with `DocResponse`
   (headers built as bytes; 304s too). In-process ASGI call, near-cache hit: 16.0 → 11.6 µs
   of CPU; a 304: 15.7 → 11.9 µs; a coalesced miss (20 at a time): 52 → 31 µs (with 1).
3. `jobs.StatusFastPath` (ASGI middleware, registered by create_app): plain
   `GET /v1/jobs/{id}` answered before Starlette's exception middleware and router. In-process:
   hit 11.6 → 5.0 µs, miss 31 → 20 µs. `jobtier-routed` above is the same server without it.

Over HTTP (A/B: two servers on one Redis, interleaved runs, wrk c50, medians of 3; API server
CPU µs per request, the steadier figure on a shared machine):

| step | hot keys | spread keys |
|---|---|---|
| before | 35.7 | 82.5 |
| 1 + 2 | 32.1 | 62.0 |
| 1 + 2 + 3 | 26.5 | 48.7 |

4. The fast path moved out of Starlette's middleware stack: `create_app` returns
   `app.JobtierApp`, whose `__call__` answers the plain status read before anything of
   Starlette runs (`ServerErrorMiddleware` wrapped `send` in a closure for every request),
   sends two raw ASGI messages instead of a Response object, and takes a near-cache hit
   without a coroutine (`StatusReader.near_hit`). In-process ASGI call (the harness of
   bench/status_asgi.py: a task per request as granian makes it, 20 per loop iteration), CPU
   per request, medians of 7 in two interleaved rounds against the commit before: hit
   9.8 / 10.1 → 8.0 / 8.2 µs (of which 4.1 µs is the harness: the task, the scope), miss
   25.2 / 26.1 → 24.0 / 23.5 µs. Over HTTP, wrk c50, A/B interleaved, medians of 3 (load
   average 3-3.8 from other work): hot 25.4 → 23.4, spread 44.3 → 43.3 µs.

Where the rest of a read's CPU goes (py-spy and perf on the server under open20k, hot keys):
about half is granian's own threads (the tokio I/O thread, mostly in the kernel: socket
reads and writes, wake-ups; and the thread that takes the GIL to build each scope and
hand the request to the event loop); of the event loop thread's share, a third is the ASGI
bridge (an asyncio Task per request, its scope), the rest our app, GC a few per cent.
It is not spinning but hand-offs: per request the three threads switch 2.5 times at 20K req/s
and 9 times at 1K req/s, so the CPU per request falls as the rate rises (163 µs at 1K/s, 28
at 20K/s), and as the core gets busier: with CPU 0 to itself the server spends ~48 µs a read
at 20K/s (95 % of the core, p99 2 ms in status_read-open20k.md), squeezed to half the core
by other work 24-29 µs, at the same 20K/s (more requests per wake-up).
A miss costs a Redis round trip per batch (about 5 ids a batch at 20K req/s on spread keys):
redis-py spends ~40 µs of CPU per command beyond a bare connection's send and read, 18 of
them in its pool's get and release.
"""


# --- main -------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=100_000, help="jobs filled (100000)")
    p.add_argument("--runs", type=int, help="runs; figures are medians (3; --quick: 1)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measured cell (10)")
    p.add_argument(
        "--configs",
        default=",".join(c for c in CONFIGS if c != BEFORE),
        help=f"comma list of {', '.join(CONFIGS)}",
    )
    p.add_argument("--mixes", default="hot,spread,churn")
    p.add_argument("--modes", default="closed,open10k,open20k")
    p.add_argument("--phases", default="read,memory,submit", help="read, memory, submit")
    p.add_argument("--memory-seconds", type=float, default=120.0, help="long run for RSS (120)")
    p.add_argument(
        "--memory-warm", type=float, default=20.0, help="cache-filling run before it (20)"
    )
    p.add_argument(
        "--before",
        metavar="REV",
        help=f"also measure jobtier at this git revision ({BEFORE}), in the same runs",
    )
    p.add_argument(
        "--quick", action="store_true", help="1 run (unless --runs), 4 s cells, 20K jobs"
    )
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="measure nothing: rebuild the markdown from a saved results file",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.jobs = 4.0, 20_000
        args.memory_seconds, args.memory_warm = 20.0, 5.0
    args.runs = args.runs or (1 if args.quick else 3)
    args.configs = [c for c in args.configs.split(",") if c]
    if args.before:
        tree = baseline_tree(args.before)
        CONFIGS[BEFORE] = dataclasses.replace(CONFIGS[BEFORE], env={"BENCH_SRC": str(tree / "src")})
        if BEFORE not in args.configs:
            at = args.configs.index("jobtier") + 1 if "jobtier" in args.configs else 0
            args.configs.insert(at, BEFORE)
    elif BEFORE in args.configs:
        p.error(f"{BEFORE} needs --before REV")
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs: {', '.join(sorted(unknown))}")
    args.mixes, args.modes, args.phases = (
        set(x.split(",")) for x in (args.mixes, args.modes, args.phases)
    )
    return args


def rerender(path: Path) -> None:
    """Rebuild status_read.md from a saved JSON (after the notes in this file change)."""
    data = json.loads(path.read_text())
    saved = dict(data["settings"])
    for key in ("mixes", "modes", "phases"):
        saved[key] = set(saved[key])
    args = argparse.Namespace(**saved)
    env = {k: data[k] for k in ("command", "date", "machine", "versions", "commit")}
    markdown = render(data["summary"], data["memory"], data["submits"], args, env)
    print(markdown)
    save(results_name(args), data, markdown)


def results_name(args: argparse.Namespace) -> str:
    """A smoke test's results never replace the full run's."""
    return "status_read-quick" if getattr(args, "quick", False) else "status_read"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.render:
        rerender(args.render)
        return
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {int(LOAD_CPUS)})  # children (Redis, generators) inherit it
    env = environment()
    started = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {line}", flush=True)

    with (
        tempfile.TemporaryDirectory(prefix="jobtier-status-read-") as folder,
        local_redis() as server,
    ):
        tmp = Path(folder)
        site = tmp / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        openloop = build_openloop(tmp)
        fill_ids = asyncio.run(fill(server.url, args.jobs))
        log(f"filled {len(fill_ids):,} jobs")
        rows = (
            read_runs(args, server.url, fill_ids, tmp, site, openloop, log)
            if "read" in args.phases
            else []
        )
        memory = (
            memory_runs(args, server.url, fill_ids, tmp, site, openloop, log)
            if "memory" in args.phases
            else []
        )
        submits = (
            submit_runs(args, server.url, tmp, site, openloop, log)
            if "submit" in args.phases
            else []
        )
    summary = summarise(rows)
    markdown = render(summary, memory, submits, args, env)
    print(markdown)
    if not args.no_save:
        data = {
            **env,
            "settings": {
                k: sorted(v) if isinstance(v, set) else v
                for k, v in vars(args).items()
                if k != "render"
            },
            "summary": summary,
            "memory": memory,
            "submits": submits,
            "runs": rows,
        }
        for path in save(results_name(args), data, markdown):
            print(f"saved {path}")


if __name__ == "__main__":
    main()
