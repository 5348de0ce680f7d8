"""Benchmark: where Redis spends its CPU in each transition, from a sampling profile.

``bench/transitions.py`` can split a script's time only into the commands' own time
(INFO commandstats) and "the rest". This program profiles the redis-server process with
``perf record`` (DWARF call graphs, which need no debug symbols: the unwind tables are in the
stripped binary, and redis-server exports its functions' names) while the workload of
transitions.py runs (submit, claim, complete of no-op jobs, straight through the scripts, on
a scratch Redis with AOF ``everysec``), one recording per transition. Every sample is put in
one part by its call chain:

* Lua interpreter: the VM itself (bytecode, string interning, tables, garbage collection);
* Lua libraries: cjson, string, table, math and base functions called by the scripts;
* redis.call, conversion: the arguments copied from Lua into Redis and the reply parsed back
  into Lua values (script_lua.c, around each call);
* redis.call, dispatch: what ``scriptCall``/``call`` do around the command (ACL, command
  look-up, latency and slowlog bookkeeping, propagation of the write);
* commands: each command's own function (hmget, hset, xadd, ...);
* AOF: the script's writes fed to the append-only buffer after the script (MULTI/EXEC
  around them) and the buffer written to the file;
* network, EVALSHA around the script (script look-up, KEYS/ARGV, the reply), the rest.

A part's µs per job is its share of the samples times the phase's Redis CPU per job (INFO
cpu, measured over the same phase). Needs ``perf`` (run as root or with
perf_event_paranoid <= 1) and the redis-server build of this machine (Debian 7.0.15: its
Lua functions are static, so their place is told by the address ranges between the
exported names around them).

    .venv/bin/python bench/transitions_profile.py            # 20K jobs
    .venv/bin/python bench/transitions_profile.py --jobs 5000 --no-save
    .venv/bin/python bench/transitions_profile.py --rev main     # the scripts at main

Results: bench/results/transitions_profile.json and .md (``transitions_profile-<rev>`` with
``--rev``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jobtier.store.calls import complete_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    environment,
    fmt,
    header_markdown,
    local_redis,
    redis_cpu,
    save,
    script_queue,
    table,
)
from redis.asyncio import Redis
from transitions import PHASES, git_sources, submit_for, use_sources

from jobtier.core.model import JobSpec

Frame = tuple[int, str, str]  # address in its object, symbol ('[unknown]'), object path


class Layout:
    """Which part of redis-server an address is in, from the exported symbols around it."""

    def __init__(self, binary: str) -> None:
        out = subprocess.run(["nm", "-D", binary], capture_output=True, text=True, check=True)
        syms = []
        for line in out.stdout.splitlines():
            p = line.split()
            if len(p) == 3 and p[1] in "Tt":
                syms.append((int(p[0], 16), p[2]))
        syms.sort()
        self.binary = os.path.basename(binary)
        self.addrs = [a for a, _ in syms]
        self.names = [n for _, n in syms]
        at = {n: a for a, n in syms}
        try:
            # (start, end, module): the Lua sources are linked in this order (deps/lua's
            # Makefile), so each module spans from the exported name before it to its own
            self.ranges = [
                (at["callReplyCreateError"] + 0x100, at["luaCallFunction"], "script_lua"),
                (at["lua_checkstack"] - 0x2000, at["luaL_where"], "luacore"),
                (at["luaL_where"], at["luaopen_base"] + 0x100, "lualib"),
                (at["luaopen_base"] + 0x100, at["luaopen_string"] + 0x100, "lualib"),
                (at["luaopen_string"] + 0x100, at["luaopen_cjson_safe"] + 0x100, "cjson"),
                (at["strbuf_init"], at["counts_index_for"], "cjson"),
            ]
        except KeyError as exc:
            raise SystemExit(f"{binary} does not export {exc}: another Redis build") from None

    def module(self, frame: Frame) -> str | None:
        addr, _, obj = frame
        if not obj.endswith(self.binary):
            return None
        for start, end, name in self.ranges:
            if start <= addr < end:
                return name
        return None


def samples(path: Path) -> Iterator[tuple[int, list[Frame]]]:
    """(period, frames from the root down) of every sample in a perf.data file."""
    out = subprocess.run(
        ["perf", "script", "-i", str(path), "-F", "period,ip,sym,dso"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for block in out.split("\n\n"):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or not lines[0].split()[0].isdigit():
            continue
        frames = []
        for line in lines[1:]:
            m = re.match(r"\s*([0-9a-f]+) (.*) \((.*)\)$", line)
            if m:
                frames.append((int(m.group(1), 16), m.group(2), m.group(3)))
        yield int(lines[0].split()[0]), frames[::-1]


PROPAGATE = {"alsoPropagate", "propagateNow", "propagatePendingCommands", "redisOpArrayAppend"}


def part(layout: Layout, frames: list[Frame]) -> str:
    names = [f[1] for f in frames]
    if "luaCallFunction" in names:
        rest = frames[names.index("luaCallFunction") + 1 :]
        if rest and layout.module(rest[0]) == "script_lua":
            return "EVALSHA around the script (KEYS/ARGV, reply)"
        for k, f in enumerate(rest):
            mod = layout.module(f)
            if mod == "luacore" or f[1] == "lua_pcall":
                continue
            if mod == "script_lua" or f[1].startswith("lua_push"):
                inner = [x[1] for x in rest[k:]]
                if "scriptCall" not in inner:
                    return "redis.call: conversion (arguments, reply into Lua)"
                after = inner[inner.index("scriptCall") + 1 :]
                if "call" not in after:
                    return "redis.call: dispatch (ACL, look-up, checks)"
                below = after[after.index("call") + 1 :]
                first = below[0] if below else ""
                if first.endswith("Command"):
                    name = first.removesuffix("Command").removesuffix("Generic")
                    return f"command: {name.lower()}"
                return "redis.call: dispatch (ACL, look-up, checks)"
            if mod in ("cjson", "lualib"):
                return "Lua libraries (cjson, string, table, base)"
            break
        return "Lua interpreter (VM, strings, tables, GC)"
    if "evalGenericCommand" in names:
        return "EVALSHA around the script (KEYS/ARGV, reply)"
    for key, label in (
        ("propagatePendingCommands", "AOF: the script's writes fed to the buffer"),
        ("feedAppendOnlyFile", "AOF: the script's writes fed to the buffer"),
        ("flushAppendOnlyFile", "AOF: buffer written to the file"),
        ("bioProcessBackgroundJobs", "AOF: buffer written to the file"),
        ("readQueryFromClient", "network: requests read and parsed"),
        ("writeToClient", "network: replies written"),
        ("handleClientsWithPendingWritesUsingThreads", "network: replies written"),
    ):
        if key in names:
            return label
    return "other (cron, event loop, kernel)"


async def main(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (apt-get install linux-perf)")
    cpu: dict[str, float] = {}
    with local_redis(aof=True) as server:
        redis = Redis.from_url(server.url)
        try:
            await redis.config_set("auto-aof-rewrite-percentage", 0)  # as transitions.py
            pid = int((await redis.info("server"))["process_id"])
            binary = os.readlink(f"/proc/{pid}/exe")
            queue = await script_queue(redis, server.url)  # a new deployment's job format
            sources = git_sources(args.rev) if args.rev else None
            use_sources(queue, sources)
            await queue.scripts.load()
            items = [
                queue.produce.prepare(JobSpec(type="noop", payload=None), "t1")
                for _ in range(args.jobs)
            ]
            s = queue.settings
            claimed: list[Any] = []

            async def submit() -> None:
                for i in range(0, len(items), args.submit_batch):
                    part = items[i : i + args.submit_batch]
                    call = submit_for(sources, 0, part, s.idempotency_ttl_seconds * 1000)
                    await queue.scripts.call_many([call])

            async def claim() -> None:
                while len(claimed) < len(items):
                    batch = await queue.scripts.claim(0, "w1", args.claim_batch, 60_000)
                    if not batch.jobs:
                        raise RuntimeError("claim found nothing: the submit phase did not queue")
                    claimed.extend(batch.jobs)

            async def complete() -> None:
                for i in range(0, len(claimed), args.complete_batch):
                    done = [
                        (j.id, j.lease_version, b"") for j in claimed[i : i + args.complete_batch]
                    ]
                    call = complete_call(0, "w1", s.retention_seconds, done)
                    await queue.scripts.call_many([call])

            work: dict[str, Callable[[], Any]] = {
                "submit": submit, "claim": claim, "complete": complete,
            }  # fmt: skip
            for phase in PHASES:
                rec = await asyncio.create_subprocess_exec(
                    "perf", "record", "-q", "-F", str(args.frequency), "--call-graph",
                    "dwarf,16384", "-p", str(pid), "-o", str(folder / f"{phase}.data"),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                try:
                    await asyncio.sleep(0.5)  # perf attached
                    cpu0 = await redis_cpu(redis)
                    await work[phase]()
                    await redis.ping()
                    cpu[phase] = 1e6 * (await redis_cpu(redis) - cpu0) / len(items)
                finally:
                    rec.send_signal(signal.SIGINT)
                    await asyncio.wait_for(rec.wait(), 60)
        finally:
            await redis.aclose()
    layout = Layout(binary)
    shares: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        counts: Counter[str] = Counter()
        for period, frames in samples(folder / f"{phase}.data"):
            counts[part(layout, frames)] += period
        total = sum(counts.values()) or 1
        shares[phase] = {k: v / total for k, v in counts.items()}
    return {"redis_cpu_us_per_job": cpu, "shares": shares}


def render(result: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    md = header_markdown("Transitions profiled: where Redis's CPU goes, part by part", env)
    md += (
        f"\n{args.jobs:,} no-op jobs (payload null), one shard, one tenant, submit "
        f"{args.submit_batch} per call, claim {args.claim_batch}, complete "
        f"{args.complete_batch}; scripts called directly ("
        + (f"at `{args.rev}`" if args.rev else "the working tree's")
        + "). Redis AOF `everysec`. `perf record` "
        f"at {args.frequency} Hz with DWARF call graphs on redis-server, one recording per "
        "transition; each sample goes to one part by its call chain (see the program's "
        "docstring). µs/job = the part's share of the samples x the transition's Redis CPU "
        "per job over the same phase.\n\n"
    )
    cpu, shares = result["redis_cpu_us_per_job"], result["shares"]
    parts = sorted(
        {k for p in PHASES for k in shares[p]},
        key=lambda k: -sum(shares[p].get(k, 0) * cpu[p] for p in PHASES),
    )
    rows = []
    for k in parts:
        us = [shares[p].get(k, 0.0) * cpu[p] for p in PHASES]
        rows.append([k, *[f"{fmt(u, 1)} ({100 * shares[p].get(k, 0.0):.0f} %)"
                          for u, p in zip(us, PHASES, strict=True)], fmt(sum(us), 1)])  # fmt: skip
    rows.append(["Redis CPU", *[fmt(cpu[p], 1) for p in PHASES], fmt(sum(cpu.values()), 1)])
    md += table(["part: µs per job (share)", *PHASES, "total"], rows) + "\n"
    return md


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=20_000, help="jobs (20000)")
    p.add_argument("--submit-batch", type=int, default=32, help="jobs per submit call (32)")
    p.add_argument("--claim-batch", type=int, default=25, help="most jobs per claim (25)")
    p.add_argument("--complete-batch", type=int, default=25, help="jobs per completion (25)")
    p.add_argument("--frequency", type=int, default=1500, help="samples per second (1500)")
    p.add_argument("--rev", default="", help="profile the scripts at this git revision "
                   "(default: the working tree's)")  # fmt: skip
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    return p.parse_args(argv)


def run(argv: list[str] | None = None, report: Callable[[str], None] = print) -> None:
    args = parse(argv)
    env = environment()
    with tempfile.TemporaryDirectory(prefix="jobtier-perf-") as folder:
        result = asyncio.run(main(args, Path(folder)))
    md = render(result, args, env)
    report(md)
    if not args.no_save:
        name = f"transitions_profile-{args.rev}" if args.rev else "transitions_profile"
        save(name, {"environment": env, "args": vars(args), **result}, md)


if __name__ == "__main__":
    run()
