"""Durable submit's price, and the window it closes.

One API process (granian, one worker) in front of a master with one replica, both on
loopback; ``openloop`` (bench/openloop.c) sends POST /v1/jobs at a fixed rate (open loop:
latency from the intended send time, so a stall is measured, not skipped). The two modes
alternate in the same run, several rounds each, on the same servers:

* ``plain``: ``Jobtier-Replicas: 0``, the default: acknowledged once the master ran it.
* ``durable``: ``Jobtier-Replicas: 1``: the submit's script call and WAIT 1 on one
  connection, acknowledged once the replica has it (store/durable.py).

Reported per mode: the medians over rounds of p50 / p99 / p99.9 latency, the answers (any
non-2xx is counted), and WAIT's cost: the difference of the medians, and the time Redis
reports per WAIT call (INFO commandstats).

During the plain rounds a sampler thread reads the master's ``master_repl_offset`` and the
replica's ``slave_repl_offset`` in turn, as fast as it can: how far behind the replica runs
without durable submit, in bytes, in submits (bytes over the replication bytes a submit
costs, measured over the round) and in milliseconds (for each master sample, the time until
the replica's offset reached it). That is the asynchronous replication window: what a
master's sudden death loses when it has not reached the replica.

Usage: python bench/durable_submit.py [--rate 1000] [--seconds 10] [--rounds 3]
Load only on 127.0.0.1; every child (Redis, the API, openloop) is stopped on every exit.
"""

from __future__ import annotations

import argparse
import bisect
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, fmt, header_markdown, median, percentile, save, table  # noqa: E402
from common_http import (  # noqa: E402
    ApiProcess,
    build_openloop,
    http_request,
    run_openloop,
    write_requests,
)

from jobtier.dev.local_redis import LocalRedis, free_port  # noqa: E402

KEY, TENANT, ADMIN = "key-bench", "bench", "key-bench-admin"
MODES = {"plain": 0, "durable": 1}
TARGET_P99_MS = 15.0


def start_servers(folder: Path) -> tuple[LocalRedis, LocalRedis]:
    master = LocalRedis(folder / "master").start()
    replica = LocalRedis(folder / "replica", options={"replicaof": ("127.0.0.1", master.port)})
    try:
        replica.start()
        with redis.Redis(port=replica.port) as r:
            deadline = time.monotonic() + 30
            while r.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise TimeoutError("the replica did not attach")
                time.sleep(0.05)
    except BaseException:
        replica.stop()
        master.stop()
        raise
    return master, replica


def start_api(master: LocalRedis, folder: Path) -> ApiProcess:
    port = free_port()
    env = {
        "JOBTIER_REDIS_URL": master.url,
        "JOBTIER_API_KEYS": f"{KEY}:{TENANT}",
        "JOBTIER_ADMIN_KEY": ADMIN,
        "JOBTIER_API_WORKERS": "1",
        "JOBTIER_API_PORT": str(port),
        "JOBTIER_LOG_LEVEL": "WARNING",
        "JOBTIER_REQUIRE_KNOWN_TYPES": "0",
        "JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS": "500",
        # no Postgres here: the submit path never needs it; the closed port fails its probes fast
        "JOBTIER_DATABASE_URL": "postgresql://jobtier@127.0.0.1:9/jobtier",
        "PYTHONPATH": str(HERE.parent / "src"),
    }
    # not pinned: on a machine shared with other work, a pinned API waits for its one CPU
    api = ApiProcess(port, env, log=folder / "api.log")
    return api.wait_ready()


def requests_file(folder: Path, port: int, replicas: int, n: int = 20_000) -> Path:
    body = b'{"type":"bench.noop","payload":{"n":1}}'
    one = http_request("POST", "/v1/jobs", KEY, body, port, Jobtier_Replicas=str(replicas))
    return write_requests(folder / f"submit-{replicas}.bin", [one] * n)


class LagSampler(threading.Thread):
    """The master's offset and the replica's, read in turn until stopped."""

    def __init__(self, master: LocalRedis, replica: LocalRedis) -> None:
        super().__init__(daemon=True)
        self.m = redis.Redis(port=master.port)
        self.r = redis.Redis(port=replica.port)
        self.stop_flag = threading.Event()
        self.master: list[tuple[float, int]] = []  # (time, master_repl_offset)
        self.replica: list[tuple[float, int]] = []  # (time, slave_repl_offset)

    def run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                off = int(self.m.info("replication")["master_repl_offset"])
                self.master.append((time.monotonic(), off))
                off = int(self.r.info("replication")["slave_repl_offset"])
                self.replica.append((time.monotonic(), off))
        finally:
            self.m.close()
            self.r.close()

    def lags(self, bytes_per_submit: float) -> dict[str, Any]:
        """Lag in bytes (master sample against the replica sample right after it), in
        submits, and in ms (until the replica's offset reached the master's sample)."""
        r_times = [t for t, _ in self.replica]
        r_offs = [o for _, o in self.replica]
        lag_bytes: list[float] = []
        lag_ms: list[float] = []
        for t, off in self.master:
            i = bisect.bisect_left(r_times, t)
            if i >= len(r_times):
                break
            lag_bytes.append(max(0, off - r_offs[i]))
            j = i
            while j < len(r_offs) and r_offs[j] < off:
                j += 1
            if j < len(r_offs):
                lag_ms.append((r_times[j] - t) * 1000)
        per = max(bytes_per_submit, 1.0)
        lag_submits = [b / per for b in lag_bytes]
        return {
            "samples": len(lag_bytes),
            "behind_share": sum(1 for b in lag_bytes if b > 0) / max(len(lag_bytes), 1),
            "bytes": _dist(lag_bytes),
            "submits": _dist(lag_submits),
            "ms": _dist(lag_ms),
        }


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return median(known) if known else None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _dist(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "p99.9": None, "max": None}
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "p99.9": percentile(values, 99.9),
        "max": max(values),
    }


def wait_stats(m: redis.Redis) -> tuple[int, float]:
    stats = m.info("commandstats").get("cmdstat_wait", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


def one_round(
    mode: str,
    args: argparse.Namespace,
    api: ApiProcess,
    master: LocalRedis,
    replica: LocalRedis,
    files: dict[str, Path],
    openloop: Path,
) -> dict[str, Any]:
    with redis.Redis(port=master.port) as m:
        calls0, usec0 = wait_stats(m)
        off0 = int(m.info("replication")["master_repl_offset"])
        sampler = LagSampler(master, replica) if mode == "plain" else None
        if sampler is not None:
            sampler.start()
        try:
            load = run_openloop(
                openloop, api.port, files[mode], args.rate, args.seconds, warmup=2.0,
                connections=200,
            )  # fmt: skip
        finally:
            if sampler is not None:
                sampler.stop_flag.set()
                sampler.join()
        calls1, usec1 = wait_stats(m)
        off1 = int(m.info("replication")["master_repl_offset"])
    submits = max(int(load["responses"]), 1)
    out: dict[str, Any] = {
        "mode": mode,
        "load": load,
        "wait_calls": calls1 - calls0,
        "wait_usec_per_call": (usec1 - usec0) / (calls1 - calls0) if calls1 > calls0 else None,
        "replication_bytes_per_submit": (off1 - off0) / submits,
    }
    if sampler is not None:
        out["lag"] = sampler.lags(out["replication_bytes_per_submit"])
    return out


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in rounds if r["mode"] == mode]
        lat = {
            q: _median([r["load"]["latency_ms"][q] for r in mine]) for q in ("p50", "p99", "p99.9")
        }
        statuses = {k: sum(r["load"]["status"][k] for r in mine) for k in ("2xx", "4xx", "5xx")}
        out[mode] = {
            "rounds": len(mine),
            "latency_ms": lat,
            "per_round_p99_ms": [r["load"]["latency_ms"]["p99"] for r in mine],
            "achieved_rps": _median([r["load"]["achieved_rps"] for r in mine]),
            "status": statuses,
            "unanswered": sum(r["load"]["unanswered"] + r["load"]["unsent"] for r in mine),
        }
        out[mode]["wait_usec_per_call"] = _median([r["wait_usec_per_call"] for r in mine])
    out["wait_cost_ms"] = {
        q: _minus(out["durable"]["latency_ms"][q], out["plain"]["latency_ms"][q])
        for q in ("p50", "p99", "p99.9")
    }
    lags = [r["lag"] for r in rounds if "lag" in r]
    out["replication_window"] = {
        unit: {q: _median([lag[unit][q] for lag in lags]) for q in ("p50", "p99", "p99.9", "max")}
        for unit in ("bytes", "submits", "ms")
    }
    out["replication_window"]["behind_share"] = _median([lag["behind_share"] for lag in lags])
    out["replication_window"]["samples"] = sum(lag["samples"] for lag in lags)
    out["durable_p99_target_ms"] = TARGET_P99_MS
    p99 = out["durable"]["latency_ms"]["p99"]
    out["durable_p99_met"] = p99 is not None and p99 < TARGET_P99_MS
    return out


def _f(value: Any, digits: int = 0) -> str:
    return "-" if value is None else fmt(value, digits)


def markdown(env: dict[str, Any], args: argparse.Namespace, s: dict[str, Any]) -> str:
    head = header_markdown("Durable submit: the price of WAIT, and the window it closes", env)
    rows = []
    for mode in MODES:
        m = s[mode]
        lat = m["latency_ms"]
        rows.append(
            [
                mode,
                str(m["rounds"]),
                _f(m["achieved_rps"]),
                _f(lat["p50"], 2),
                _f(lat["p99"], 2),
                _f(lat["p99.9"], 2),
                ", ".join(_f(p, 2) for p in m["per_round_p99_ms"]),
                f"{m['status']['2xx']} / {m['status']['4xx']} / {m['status']['5xx']}",
                _f(m["wait_usec_per_call"], 0),
            ]
        )
    w = s["replication_window"]
    cost = s["wait_cost_ms"]
    window_rows = [
        [unit, *(_f(w[unit][q], 2) for q in ("p50", "p99", "p99.9", "max"))]
        for unit in ("ms", "submits", "bytes")
    ]
    return (
        head + f"- load: POST /v1/jobs at {args.rate:g}/s open loop (openloop.c, 200 connections, "
        f"2 s warm-up), {args.seconds:g} s per round, {args.rounds} rounds per mode, "
        "interleaved; one API process (granian, 1 worker), not pinned; a "
        "master and one replica (AOF everysec) on loopback\n\n"
        "## Submit latency (medians over rounds)\n\n"
        + table(
            [
                "mode",
                "rounds",
                "achieved/s",
                "p50 ms",
                "p99 ms",
                "p99.9 ms",
                "p99 per round",
                "2xx / 4xx / 5xx",
                "WAIT µs/call (Redis)",
            ],
            rows,
        )
        + f"\n\nWAIT's cost per submit (durable minus plain): p50 {_f(cost['p50'], 2)} ms, "
        f"p99 {_f(cost['p99'], 2)} ms, p99.9 {_f(cost['p99.9'], 2)} ms. Target: durable "
        f"p99 under {TARGET_P99_MS:g} ms: {'met' if s['durable_p99_met'] else 'NOT met'}.\n\n"
        "## The asynchronous replication window (plain rounds)\n\n"
        f"How far the replica ran behind the master ({w['samples']} sample pairs; behind in "
        f"{_f((w['behind_share'] or 0) * 100, 1)}% of them). A master killed at that moment loses "
        "that much of what it acknowledged.\n\n"
        + table(["lag", "p50", "p99", "p99.9", "max"], window_rows)
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="durable_submit")
    parser.add_argument("--keep", action="store_true", help="keep the logs and data folder")
    args = parser.parse_args()
    env = environment()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-durable-") as tmp:
        folder = Path(tmp)
        if args.keep:
            folder = Path(tempfile.mkdtemp(prefix="bench-durable-kept-"))
        openloop = build_openloop(folder)
        master, replica = start_servers(folder)
        api: ApiProcess | None = None
        try:
            api = start_api(master, folder)
            files = {mode: requests_file(folder, api.port, n) for mode, n in MODES.items()}
            for i in range(args.rounds):
                # each round starts with the other mode: neither always runs first
                order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    result = one_round(mode, args, api, master, replica, files, openloop)
                    result["round"] = i
                    rounds.append(result)
                    lat = {k: v or -1.0 for k, v in result["load"]["latency_ms"].items()}
                    print(
                        f"round {i} {mode} ({result['load']['responses']} answers): p50 {lat['p50']:.2f} p99 {lat['p99']:.2f} "
                        f"p99.9 {lat['p99.9']:.2f} ms, status {result['load']['status']}",
                        flush=True,
                    )
        finally:
            if api is not None:
                api.stop()
            replica.stop()
            master.stop()
    s = summary(rounds)
    data = {"environment": env, "args": vars(args), "summary": s, "rounds": rounds}
    paths = save(args.name, data, markdown(env, args, s))
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
