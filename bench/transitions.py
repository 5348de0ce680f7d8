"""Benchmark: where a job's Redis CPU and append-only-file bytes go, transition by transition.

Runs the three transitions of a no-op job — submit, claim, complete — straight through the
scripts (no worker, no HTTP) on a scratch Redis (AOF ``everysec``, ``noeviction``), one phase
at a time, and for each phase reads:

* Redis CPU (``INFO cpu``, user + system) and the scripts' own time (``INFO commandstats``:
  ``fcall`` or ``evalsha`` usec, which includes the commands the script ran);
* per command the script ran: calls and usec (``INFO commandstats`` counts commands run
  inside scripts too); what is left of the script's time is the Lua interpreter's own work
  (building keys, rendering the status document, cjson);
* the bytes the phase appended to the AOF, parsed back into its commands (RESP) and
  attributed to each command name; ``MULTI``/``EXEC`` are the wrapper Redis puts around
  every script's writes. SPUBLISH is not in the AOF (it is replicated, never persisted).

Then, not a transition, each finished job's status document is read once by
``read_status.lua`` (``READ_BATCH`` keys a call, as the status reader batches misses): what a
status read that misses the API's near cache costs Redis. A job in format 3 stores no
document, and the script renders it.

Two variants of the scripts run in the same process, interleaved run by run: the working
tree's (``after``) and those of a git revision (``before``, ``--before``, default
``HEAD``), so a cut's saving is measured against its baseline in the same run.

    .venv/bin/python bench/transitions.py                       # 20K jobs, 3 runs
    .venv/bin/python bench/transitions.py --before main --jobs 5000 --runs 1

Results: bench/results/transitions.json and bench/results/transitions.md (medians of runs).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobtier.store.calls import Call, SubmitItem, complete_call, submit_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    environment,
    flush,
    fmt,
    git_lua,
    header_markdown,
    local_redis,
    median,
    redis_cpu,
    save,
    script_queue,
    set_format,
    table,
    wait_aof_rewrite,
)
from redis.asyncio import Redis

from jobtier.core.model import JobSpec
from jobtier.engine.queue import Queue
from jobtier.store.scripts import NAMES, Library, Script, library, lua_source

PHASES = ("submit", "claim", "complete")
READ = "read"  # not a transition: read_status.lua over every finished job
READ_BATCH = 100


@dataclass
class Revision:
    """Another git revision's scripts: their EVAL texts (includes expanded, as
    scripts.lua_source makes them), and their function library when the revision has one."""

    texts: dict[str, str]
    library: Library | None


def git_sources(rev: str) -> Revision:
    """Every script at git revision ``rev``; a revision from before the function library
    (its lib.lua has no begin()) has none, and its scripts run by EVALSHA."""

    def show(name: str) -> str:
        return git_lua(rev, name)

    texts = {}
    for name in (*NAMES, "read_status"):
        try:
            texts[name] = lua_source(name, read=show)
        except subprocess.CalledProcessError:
            continue  # a script that did not exist at rev
    lib = None
    if "local function begin(" in show("lib.lua"):
        lib = Library([n for n in NAMES if n in texts], read=show)
    return Revision(texts, lib)


def submit_for(
    sources: Revision | None, shard: int, items: Sequence[SubmitItem], ttl_ms: int
) -> Call:
    """A submit call as ``sources``' submit.lua takes it (None: the working tree's): one from
    before jobs kept a trace context read the job count from ARGV[3], where the traceparent
    now goes, so it is left out; one that reads fewer fields per job (those added since, the
    expiry's and the timeout's, are last and unset here) gets only the fields it reads."""
    call = submit_call(shard, items, ttl_ms)
    if sources is None:
        return call
    text = sources.texts.get("submit")
    if text is None:
        return call
    name, shard, args = call
    found = re.search(r"then (\d+) fields per job", text)
    width, given = (int(found[1]) if found else 0), len(items[0].args()) if items else 0
    if 0 < width < given:
        jobs = [args[3 + i * given : 3 + i * given + width] for i in range(len(items))]
        args = [*args[:3], *(v for job in jobs for v in job)]
    if "traceparent" in text:
        return (name, shard, args)
    return (name, shard, [args[0], *args[2:]])


def use_sources(queue: Queue, sources: Revision | None) -> None:
    """Point the queue's script wrappers at another revision's scripts, run as that revision
    runs them: by FCALL from its function library, or by EVALSHA before it had one (None:
    the working tree's, from its library)."""
    for name in NAMES:
        lib = library() if sources is None else sources.library
        if sources is not None and name not in sources.texts:
            lib = None  # (a script the revision did not have: the working tree's, by EVALSHA)
        script = Script(name, lib)
        if sources is not None and name in sources.texts:
            script.text = sources.texts[name]
            script.sha = hashlib.sha1(script.text.encode()).hexdigest()
        queue.scripts.by_name[name] = script


# --- the AOF, read back ---------------------------------------------------------------------
async def aof_file(redis: Redis) -> Path:
    """The file Redis appends to now (Redis 7: the last INCR file of the manifest)."""
    folder = (await redis.config_get("dir"))["dir"]
    sub = (await redis.config_get("appenddirname")).get("appenddirname", "appendonlydir")
    name = (await redis.config_get("appendfilename"))["appendfilename"]
    # CONFIG GET's values are strings; redis-py types them str | None
    assert folder is not None and sub is not None and name is not None
    manifest = (Path(folder) / sub / f"{name}.manifest").read_text().splitlines()
    incr = [line.split()[1] for line in manifest if " type i" in line]
    return Path(folder) / sub / incr[-1]


def resp_commands(data: bytes) -> list[tuple[str, int]]:
    """(command name, bytes) for each RESP command in ``data`` (what the AOF holds)."""
    out, i, n = [], 0, len(data)
    while i < n:
        start = i
        assert data[i : i + 1] == b"*", data[i : i + 40]
        eol = data.index(b"\r\n", i)
        count = int(data[i + 1 : eol])
        i = eol + 2
        name = ""
        for k in range(count):
            eol = data.index(b"\r\n", i)
            size = int(data[i + 1 : eol])
            if k == 0:
                name = data[eol + 2 : eol + 2 + size].decode().lower()
            i = eol + 2 + size + 2
        out.append((name, i - start))
    return out


def read_from(path: Path, offset: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read()


async def command_usec(redis: Redis) -> dict[str, tuple[int, int]]:
    info = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in info.items()}


IGNORE = frozenset({"info", "config|resetstat", "config|get", "flushall", "bgrewriteaof",
                    "script|load", "ping"})  # fmt: skip


async def measure_phase(
    redis: Redis, path: Path, jobs: int, work: Callable[[], Any]
) -> dict[str, Any]:
    await redis.config_resetstat()
    size0 = await asyncio.to_thread(os.path.getsize, path)
    cpu0 = await redis_cpu(redis)
    await work()
    await redis.ping()  # the scripts' writes reach the file before the server answers this
    cpu1 = await redis_cpu(redis)
    data = await asyncio.to_thread(read_from, path, size0)
    stats = {k: v for k, v in (await command_usec(redis)).items() if k not in IGNORE}
    aof: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, size in resp_commands(data):
        aof[name][0] += 1
        aof[name][1] += size
    # the scripts' own entries: FCALL (the function library) or EVALSHA (another revision's
    # texts, and ablated copies)
    script_usec = sum(u for k, (_, u) in stats.items() if k.startswith(("eval", "fcall")))
    inner = {k: v for k, v in stats.items() if not k.startswith(("eval", "fcall"))}
    per = {
        k: {
            "calls": c / jobs,
            "usec": u / jobs,
            "aof_bytes": aof.get(k, [0, 0])[1] / jobs,
        }
        for k, (c, u) in inner.items()
    }
    # what the AOF holds under another name (MULTI/EXEC around a script's writes, EXPIRE
    # rewritten as PEXPIREAT): counted from the file
    for k, (calls, size) in aof.items():
        if k not in per:
            per[k] = {"calls": calls / jobs, "usec": 0.0, "aof_bytes": size / jobs}
    inner_usec = sum(u for _, u in inner.values())
    return {
        "redis_cpu_us_per_job": 1e6 * (cpu1 - cpu0) / jobs,
        "script_us_per_job": script_usec / jobs,
        "lua_us_per_job": (script_usec - inner_usec) / jobs,
        "commands_per_job": sum(c for c, _ in inner.values()) / jobs,
        "aof_bytes_per_job": len(data) / jobs,
        "by_command": per,
    }


def known_format(sources: Revision) -> int:
    """The newest job format the scripts in ``sources`` write."""
    lib = sources.texts.get("claim", "")  # every script holds lib.lua
    if "'fmt'" not in lib:  # they read no mark: format 3 only (today's), or from before format 2
        return 3 if "T_PATTERN" in lib else 1
    # they write what jt:{s}:fmt names: read into FMT at the top level before the function
    # library, into fmt by begin() since
    lib = lib.lower()
    return 3 if "fmt == '3'" in lib else 2 if "== '2'" in lib else 1


async def one_variant(
    redis: Redis,
    queue: Queue,
    args: argparse.Namespace,
    sources: Revision | None,
    fmt: int,
) -> dict[str, Any]:
    use_sources(queue, sources)
    await flush(redis)
    await set_format(redis, queue.keys, fmt)
    await wait_aof_rewrite(redis)
    await redis.bgrewriteaof()
    await asyncio.sleep(0.05)
    await wait_aof_rewrite(redis)
    await queue.scripts.load()
    path = await aof_file(redis)
    payload = {"n": 1} if args.payload else None
    specs = [JobSpec(type="noop", payload=payload) for _ in range(args.jobs)]
    shard = 0
    items = [queue.produce.prepare(s, "t1") for s in specs]
    s = queue.settings
    claimed: list[Any] = []

    async def submit() -> None:
        for i in range(0, len(items), args.submit_batch):
            await queue.scripts.call_many(
                [
                    submit_for(
                        sources,
                        shard,
                        items[i : i + args.submit_batch],
                        s.idempotency_ttl_seconds * 1000,
                    )
                ]
            )

    async def claim() -> None:
        while len(claimed) < len(items):
            batch = await queue.scripts.claim(shard, "w1", args.claim_batch, 60_000)
            if not batch.jobs:
                raise RuntimeError("claim found nothing: the submit phase did not queue")
            claimed.extend(batch.jobs)

    async def complete() -> None:
        for i in range(0, len(claimed), args.complete_batch):
            part = claimed[i : i + args.complete_batch]
            call = complete_call(
                shard, "w1", s.retention_seconds, [(j.id, j.lease_version, b"") for j in part]
            )
            codes = (await queue.scripts.call_many([call]))[0]
            if any(c != 0 for c in codes):
                raise RuntimeError(f"complete refused: {codes[:5]}")

    # read_status.lua from before format 3 reads KEYS only: the argument it ignores is
    # harmless
    read_text = (sources.texts if sources else {}).get("read_status") or lua_source("read_status")
    read_sha = await redis.script_load(read_text)
    job_keys = [queue.keys.job_in(shard, item.job_id) for item in items]

    async def read() -> None:
        for i in range(0, len(job_keys), READ_BATCH):
            part = job_keys[i : i + READ_BATCH]
            docs = (await redis.evalsha(read_sha, len(part), *part, ""))[1::2]
            if not all(docs):
                raise RuntimeError("read_status.lua found no document for a finished job")

    out: dict[str, Any] = {}
    for name, work in (("submit", submit), ("claim", claim), ("complete", complete), (READ, read)):
        out[name] = await measure_phase(redis, path, len(items), work)
    # what a finished job keeps in Redis, for the record
    sample = items[len(items) // 2].job_id
    out["finished_job_bytes"] = (
        await redis.memory_usage(queue.keys.base(shard) + "job:" + sample) or 0
    )
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    before = git_sources(args.before)
    # the baseline writes the format asked for, or the newest its scripts know; the working
    # tree's scripts write format 3 only
    newest = known_format(before)
    formats = {"before": min(args.before_format or newest, newest), "after": 3}
    args.formats = formats
    runs: list[dict[str, Any]] = []
    with local_redis(aof=True) as server:
        redis = Redis.from_url(server.url)
        # a phase appends ~100 MB (20K jobs x ~5 KB): past auto-aof-rewrite-min-size (64 MB)
        # Redis would rewrite mid-phase and move the appends to a new file the phase is not
        # reading; each variant starts from its own BGREWRITEAOF instead
        await redis.config_set("auto-aof-rewrite-percentage", 0)
        queue = await script_queue(redis, server.url)
        try:
            for i in range(args.runs):
                run = {}
                for variant, sources in (("before", before), ("after", None)):
                    run[variant] = await one_variant(redis, queue, args, sources, formats[variant])
                    total = sum(run[variant][p]["redis_cpu_us_per_job"] for p in PHASES)
                    print(f"run {i + 1}/{args.runs} {variant}: Redis CPU {total:.0f} us/job",
                          file=sys.stderr, flush=True)  # fmt: skip
                runs.append(run)
        finally:
            await redis.aclose()
    return {"runs": runs, "summary": summarise(runs)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in ("before", "after"):
        v: dict[str, Any] = {}
        for phase in (*PHASES, READ):
            cells = [r[variant][phase] for r in runs]
            p: dict[str, Any] = {
                k: median([c[k] for c in cells])
                for k in (
                    "redis_cpu_us_per_job",
                    "script_us_per_job",
                    "lua_us_per_job",
                    "commands_per_job",
                    "aof_bytes_per_job",
                )
            }
            names = sorted({n for c in cells for n in c["by_command"]})
            p["by_command"] = {
                n: {
                    k: median([c["by_command"].get(n, {}).get(k, 0.0) for c in cells])
                    for k in ("calls", "usec", "aof_bytes")
                }
                for n in names
            }
            v[phase] = p
        v["finished_job_bytes"] = median([r[variant]["finished_job_bytes"] for r in runs])
        out[variant] = v
    return out


def render(summary: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    md = header_markdown("Transitions: a job's Redis CPU and AOF bytes, call by call", env)
    payload = '`{"n": 1}`' if args.payload else "null"
    md += (
        f"\n{args.jobs:,} no-op jobs (payload {payload}), one "
        f"shard, one tenant, submit {args.submit_batch} per call, claim {args.claim_batch}, "
        f"complete {args.complete_batch}; scripts called directly (no worker, no HTTP). "
        f"Redis AOF `everysec`. Medians of {args.runs} interleaved run(s) of both variants: "
        f"**before** = the scripts at `{args.before}`, job hashes in format "
        f"{args.formats['before']}; **after** = the working tree's, in format "
        f'{args.formats["after"]} (core/keys.py, "Job hashes").\n\n'
        "Redis CPU is the server's (INFO cpu), script time the `fcall`/`evalsha` usec of INFO "
        "commandstats (commands inside included), Lua = script time less the commands' own "
        "usec (key building, rendering the document, cjson). AOF bytes are parsed back from "
        "the file the phase appended to.\n\n"
    )
    rows = []
    for phase in (*PHASES, "total", READ):
        row = [phase if phase != READ else f"(read: status, {READ_BATCH} a call)"]
        for variant in ("before", "after"):
            v = summary[variant]
            cells = [v[p] for p in PHASES] if phase == "total" else [v[phase]]
            row += [
                fmt(sum(c["redis_cpu_us_per_job"] for c in cells)),
                fmt(sum(c["script_us_per_job"] for c in cells), 1),
                fmt(sum(c["lua_us_per_job"] for c in cells), 1),
                fmt(sum(c["commands_per_job"] for c in cells), 2),
                fmt(sum(c["aof_bytes_per_job"] for c in cells)),
            ]
        rows.append(row)
    heads = ["transition"]
    for variant in ("before", "after"):
        heads += [f"{variant}: Redis CPU µs/job", "script µs", "of it Lua µs", "commands",
                  "AOF bytes"]  # fmt: skip
    md += table(heads, rows) + "\n\n"
    md += "## Per command, per job\n\n"
    for phase in PHASES:
        md += f"### {phase}\n\n"
        names = sorted(
            set(summary["before"][phase]["by_command"]) | set(summary["after"][phase]["by_command"])
        )
        rows = []
        for n in names:
            b = summary["before"][phase]["by_command"].get(
                n, {"calls": 0, "usec": 0, "aof_bytes": 0}
            )
            a = summary["after"][phase]["by_command"].get(
                n, {"calls": 0, "usec": 0, "aof_bytes": 0}
            )
            rows.append([n, fmt(b["calls"], 2), fmt(b["usec"], 1), fmt(b["aof_bytes"]),
                         fmt(a["calls"], 2), fmt(a["usec"], 1), fmt(a["aof_bytes"])])  # fmt: skip
        md += table(["command", "before: calls", "µs", "AOF bytes", "after: calls", "µs",
                     "AOF bytes"], rows) + "\n\n"  # fmt: skip
    md += (
        f"A finished job's hash (MEMORY USAGE, before retention expires it): before "
        f"{fmt(summary['before']['finished_job_bytes'])} bytes, after "
        f"{fmt(summary['after']['finished_job_bytes'])} bytes.\n"
    )
    return md


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=20_000, help="jobs per run (20000)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs; medians (3)")
    p.add_argument("--before", default="HEAD", help="git revision of the baseline (HEAD)")
    p.add_argument("--submit-batch", type=int, default=32, help="jobs per submit call (32: "
                   "a 500-job submit_many over 16 shards)")  # fmt: skip
    p.add_argument("--claim-batch", type=int, default=25, help="most jobs per claim (25)")
    p.add_argument("--complete-batch", type=int, default=25, help="jobs per completion (25)")
    p.add_argument("--payload", action="store_true", help='payload {"n": 1} rather than null')
    p.add_argument(
        "--before-format",
        type=int,
        choices=(1, 2, 3),
        default=None,
        help="job hash format the baseline writes, for scripts from before format 3 only "
        "(the newest its scripts know)",
    )
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    return p.parse_args(argv)


def run(argv: list[str] | None = None, report: Callable[[str], None] = print) -> None:
    args = parse(argv)
    env = environment()
    result = asyncio.run(main(args))
    md = render(result["summary"], args, env)
    report(md)
    if not args.no_save:
        save("transitions", {"environment": env, "args": vars(args), **result}, md)


if __name__ == "__main__":
    run()
