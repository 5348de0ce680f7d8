"""Benchmark: where the Lua time of a transition goes, part by part.

``bench/transitions.py`` splits a script's time into the commands' own time and the rest,
"Lua" (building keys and the document, cjson, and each ``redis.call``'s round trip through
the interpreter: argument copies, reply conversion, propagation to the AOF). This program
splits that rest. Each part is a piece of lib.lua's work for one job, run in a loop inside
one ``EVALSHA`` over jobs that submit.lua created (queued, payload null) on a scratch Redis
(AOF ``everysec``):

    time(part) = (script usec with the part in the loop - the same loop empty) / iterations

and, for parts that call Redis, the commands' own usec (INFO commandstats) is shown apart,
so ``overhead`` is what the call costs beyond the command itself. lib.lua's top level (run
by every EVALSHA before the script's body) is measured per call against an empty script.

The parts come from the scripts at a git revision (``--rev``, default the working tree), so
a cut can be shown part by part.

    .venv/bin/python bench/lua_parts.py
    .venv/bin/python bench/lua_parts.py --rev main --no-save

Results: bench/results/lua_parts.json and bench/results/lua_parts.md (medians of runs).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobtier.store.calls import submit_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

import transitions
from common import (
    ROOT,
    environment,
    flush,
    fmt,
    git_lua,
    header_markdown,
    local_redis,
    median,
    save,
    script_queue,
    table,
)
from redis.asyncio import Redis

from jobtier.core.model import JobSpec
from jobtier.engine.queue import Queue
from jobtier.store.scripts import NAMES, lua_source

# (name, setup run once per script before the loop, body run per job in the loop). In the
# body, `id` is a queued job's id and `j` its table from load() with what commit() sets
# before render (version bumped, updated = NOW_STR); `doc` is render(j) of that job.
SETUP = """
local function quoted(s)
  if string.find(s, '[%c"/\\\\]') then
    return cjson.encode(s)
  end
  return '"' .. s .. '"'
end
local scratch = {}
local ids = redis.call('LRANGE', BASE .. 'bench:ids', 0, -1)
local js, docs = {}, {}
for i, id in ipairs(ids) do
  local j = load(id)
  j.version = int(tonumber(j.version) + 1)
  j.updated = NOW_STR
  js[i], docs[i] = j, render(j)
end
"""

PARTS: tuple[tuple[str, str], ...] = (
    ("job_key(id)", "local k = job_key(id)"),
    ("redis.call HGET of one field", "redis.call('HGET', job_key(id), 'state')"),
    ("HMGET of FIELDS alone", "redis.call('HMGET', job_key(id), unpack(FIELDS))"),
    ("load(id): HMGET + the table", "local x = load(id)"),
    ("render(j)", "local d = render(j)"),
    (
        "cjson.encode of id, type, queue, worker",
        "local a, b, c, d = cjson.encode(j.id), cjson.encode(j.type), cjson.encode(j.queue), "
        "cjson.encode(j.tenant)",
    ),
    # the escaping shortcut evaluated for render(): a pattern search for what cjson escapes,
    # then the string between quotes (SETUP defines it); not taken: it is the slower one
    (
        "candidate: pattern check + quotes, same four",
        "local a, b, c, d = quoted(j.id), quoted(j.type), quoted(j.queue), quoted(j.tenant)",
    ),
    ("int(n) (string.format %d, kept per script)", "local s = int(7)"),
    ("string.format('%d', n)", "local s = string.format('%d', 7)"),
    # commit()'s HSET arguments: a table grown by appends, or made at its size at once
    ("20 appends to an empty table", "local t = {} for k = 1, 20 do t[k] = k end"),
    (
        "20 stores into a table made for 24",
        "local t = {false, false, false, false, false, false, false, false, false, false, false, "
        "false, false, false, false, false, false, false, false, false, false, false, false, false}"
        " for k = 1, 20 do t[k] = k end",
    ),
    ("20 stores into a table kept across jobs", "for k = 1, 20 do scratch[k] = k end"),
    ("HSET of 't' (a claim's)", "redis.call('HSET', job_key(id), 't', packed_t(j))"),
    (
        "XADD of the log entry",
        "redis.call('XADD', BASE .. 'log', '*', 'd', doc, 'tn', j.tenant, 'fr', 'queued', "
        "'w', 'w1', 'pv', '1')",
    ),
    (
        "SPUBLISH of the event",
        "redis.call('SPUBLISH', BASE .. 'ev', j.id .. ' ' .. j.version .. ' ' .. j.tenant .. "
        "'\\n' .. doc)",
    ),
    ("EXPIRE of the job", "redis.call('EXPIRE', job_key(id), 86400)"),
    ("HGET payload", "redis.call('HGET', job_key(id), 'payload')"),
)

_EMPTY = "local _ = id"

# In place: the three transitions of bench/transitions.py, run by the working tree's scripts
# and by copies with one piece of commit() taken out (edits of lib.lua's text; each must
# match). What a piece costs = Redis CPU (script time) of the whole minus that of the copy.
_XADD = ("    log_entry(doc, j.tenant, from, actor, prev, extra)\n",)
ABLATIONS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("the document: not rendered, '{}' stored, logged and published",
     (("  local doc = render(j)\n", "  local doc = '{}'\n"),)),
    ("its bytes: rendered, then '{}' stored, logged and published",
     (("  local doc = render(j)\n", "  local doc = render(j)\n  doc = '{}'\n"),)),
    ("the log entry (kept, then its call's XADD)", tuple((line, "") for line in _XADD)),
    ("the event (SPUBLISH)",
     (("  redis.call('SPUBLISH', EV, j.id .. ' ' .. j.version .. ' ' .. j.tenant .. '\\n' .. doc)"
       "\n", ""),)),
)  # fmt: skip


def ablated(edits: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Every script's text (includes expanded) with lib.lua's ``edits`` applied."""
    lib = (ROOT / "src/jobtier/store/lua/lib.lua").read_text()
    for old, _ in edits:
        if old not in lib:
            raise SystemExit(f"lib.lua no longer has {old!r}: update ABLATIONS")
    out = {}
    for name in NAMES:
        text = lua_source(name)
        for old, new in edits:
            text = text.replace(old, new)
        out[name] = text
    return out


async def in_place(args: argparse.Namespace) -> dict[str, Any]:
    targs = transitions.parse(["--jobs", str(args.place_jobs)])
    variants = [("whole", None)] + [
        (name, transitions.Revision(ablated(e), None)) for name, e in ABLATIONS
    ]
    runs: list[dict[str, Any]] = []
    with local_redis(aof=True) as server:
        redis = Redis.from_url(server.url)
        await redis.config_set("auto-aof-rewrite-percentage", 0)
        queue = await script_queue(redis, server.url)  # a new deployment's job format
        try:
            for i in range(args.place_runs):
                run = {}
                for name, sources in variants:
                    run[name] = await transitions.one_variant(redis, queue, targs, sources, 3)
                runs.append(run)
                print(f"in place: run {i + 1}/{args.place_runs} done", file=sys.stderr, flush=True)
        finally:
            await redis.aclose()
    out: dict[str, Any] = {}
    for name, _ in variants:
        out[name] = {
            phase: {
                k: median([r[name][phase][k] for r in runs])
                for k in ("redis_cpu_us_per_job", "script_us_per_job")
            }
            for phase in transitions.PHASES
        }
    return {"runs": runs, "summary": out}


def lib_text(rev: str | None) -> str:
    if rev is None:
        return (ROOT / "src/jobtier/store/lua/lib.lua").read_text()
    return git_lua(rev, "lib.lua")


def loop_script(lib: str, body: str, reps: int) -> str:
    return (
        f"{lib}\n{SETUP}\nfor _ = 1, {reps} do\n  for i, id in ipairs(ids) do\n"
        f"    local j, doc = js[i], docs[i]\n    {body}\n  end\nend\nreturn #ids\n"
    )


async def stats(redis: Redis) -> dict[str, tuple[int, int]]:
    info = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in info.items()}


async def timed(redis: Redis, text: str, base: str, calls: int) -> tuple[float, float]:
    """(script usec, usec of the commands it ran) over ``calls`` EVALSHAs of ``text``."""
    sha = hashlib.sha1(text.encode()).hexdigest()
    await redis.script_load(text)
    await redis.config_resetstat()
    for _ in range(calls):
        await redis.execute_command("EVALSHA", sha, 1, base + "log", base)  # type: ignore[no-untyped-call]
    s = await stats(redis)
    script = sum(u for k, (_, u) in s.items() if k.startswith("eval"))
    inner = sum(
        u for k, (_, u) in s.items() if not k.startswith("eval") and k not in ("config|resetstat",)
    )
    return float(script), float(inner)


async def one_run(redis: Redis, queue: Queue, args: argparse.Namespace) -> dict[str, Any]:
    await flush(redis)
    shard = 0
    base = queue.keys.base(shard)
    items = [
        queue.produce.prepare(JobSpec(type="noop", payload=None), "t1") for _ in range(args.jobs)
    ]
    for i in range(0, len(items), 32):
        await queue.scripts.call_many([submit_call(shard, items[i : i + 32], 86_400_000)])
    await redis.rpush(base + "bench:ids", *[it.job_id for it in items])
    lib = lib_text(args.rev)
    n = args.jobs * args.reps
    out: dict[str, Any] = {"parts": {}}
    for name, body in PARTS:
        # the empty loop is measured next to each part: the machine's load drifts
        empty, empty_inner = await timed(
            redis, loop_script(lib, _EMPTY, args.reps), base, args.calls
        )
        script, inner = await timed(redis, loop_script(lib, body, args.reps), base, args.calls)
        out["parts"][name] = {
            "us": (script - empty) / (n * args.calls),
            "commands_us": (inner - empty_inner) / (n * args.calls),
        }
    # lib.lua's top level, per EVALSHA: lib + 'return 0' against 'return 0'
    calls = args.calls * 200
    bare, _ = await timed(redis, "return 0", base, calls)
    top, top_inner = await timed(redis, f"{lib}\nreturn 0", base, calls)
    out["top_level_us_per_call"] = (top - bare) / calls
    out["top_level_commands_us_per_call"] = top_inner / calls
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    with local_redis(aof=True) as server:
        redis = Redis.from_url(server.url)
        await redis.config_set("auto-aof-rewrite-percentage", 0)
        queue = await script_queue(redis, server.url)  # a new deployment's job format
        try:
            for i in range(args.runs):
                runs.append(await one_run(redis, queue, args))
                print(f"run {i + 1}/{args.runs} done", file=sys.stderr, flush=True)
        finally:
            await redis.aclose()
    summary: dict[str, Any] = {
        "parts": {
            name: {k: median([r["parts"][name][k] for r in runs]) for k in ("us", "commands_us")}
            for name, _ in PARTS
        },
        "top_level_us_per_call": median([r["top_level_us_per_call"] for r in runs]),
        "top_level_commands_us_per_call": median(
            [r["top_level_commands_us_per_call"] for r in runs]
        ),
    }
    out = {"runs": runs, "summary": summary}
    if args.place_runs > 0:
        out["in_place"] = await in_place(args)
    return out


def render(summary: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    md = header_markdown("Where a transition's Lua time goes, part by part", env)
    md += (
        f"\nlib.lua at {args.rev or 'the working tree'}. Each part runs in a loop inside one "
        f"EVALSHA over {args.jobs:,} queued jobs x {args.reps} repetitions, {args.calls} "
        f"calls; µs per job = (script usec with the part - the empty loop) / iterations "
        f"(INFO commandstats). For parts that call Redis, the command's own usec is shown "
        f"apart; the rest is the call's cost in the interpreter (arguments, reply, "
        f"propagation to the AOF). Medians of {args.runs} runs.\n\n"
    )
    rows = []
    for name, _ in PARTS:
        p = summary["parts"][name]
        rows.append([name, fmt(p["us"], 2), fmt(p["commands_us"], 2),
                     fmt(p["us"] - p["commands_us"], 2)])  # fmt: skip
    rows.append(["lib.lua top level, per EVALSHA (not per job)",
                 fmt(summary["top_level_us_per_call"], 2),
                 fmt(summary["top_level_commands_us_per_call"], 2),
                 fmt(summary["top_level_us_per_call"]
                     - summary["top_level_commands_us_per_call"], 2)])  # fmt: skip
    md += table(["part", "µs per job", "of it the command", "the rest"], rows) + "\n"
    return md


def render_in_place(place: dict[str, Any], args: argparse.Namespace) -> str:
    s, runs = place["summary"], place["runs"]
    whole = s["whole"]
    md = (
        f"\n## In place: what each piece of commit() costs per job\n\n"
        f"bench/transitions.py's three phases ({args.place_jobs:,} no-op jobs, AOF everysec), "
        f"run by the working tree's scripts (whole) and by copies with one piece taken out, "
        f"interleaved; medians of {args.place_runs} runs. A piece's cost is the whole's Redis "
        f"CPU (INFO cpu) minus the copy's, per job and transition; the last column is the "
        f"range of the three transitions' sum over the runs (the machine is shared: take the "
        f"spread as the error). Every piece is one the transitions must keep (the document in "
        f"the job hash, in the log and in the event); the copies only show where the time "
        f"goes.\n\n"
    )
    key = "redis_cpu_us_per_job"
    heads = ["taken out", *[f"{p}: Redis CPU µs" for p in transitions.PHASES],
             "all three", "all three: range over runs"]  # fmt: skip

    def totals(name: str) -> list[float]:
        return [sum(r[name][p][key] for p in transitions.PHASES) for r in runs]

    t = totals("whole")
    rows = [["nothing (the whole: its cost)",
             *[fmt(whole[p][key], 1) for p in transitions.PHASES],
             fmt(sum(whole[p][key] for p in transitions.PHASES), 1),
             f"{fmt(min(t), 1)} to {fmt(max(t), 1)}"]]  # fmt: skip
    for name, _ in ABLATIONS:
        d = [w - c for w, c in zip(t, totals(name), strict=True)]
        rows.append([name, *[fmt(whole[p][key] - s[name][p][key], 1) for p in transitions.PHASES],
                     fmt(sum(whole[p][key] - s[name][p][key] for p in transitions.PHASES), 1),
                     f"{fmt(min(d), 1)} to {fmt(max(d), 1)}"])  # fmt: skip
    return md + table(heads, rows) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default=None, help="git revision of lib.lua (the working tree's)")
    p.add_argument("--jobs", type=int, default=1000, help="jobs in the loop (1000)")
    p.add_argument("--reps", type=int, default=20, help="passes over the jobs per call (20)")
    p.add_argument("--calls", type=int, default=5, help="EVALSHA calls per part (5)")
    p.add_argument("--runs", type=int, default=3, help="runs; medians (3)")
    p.add_argument("--place-jobs", type=int, default=20_000, help="jobs per in-place run (20000)")
    p.add_argument("--place-runs", type=int, default=3, help="in-place runs; 0: none (3)")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    return p.parse_args(argv)


def run(argv: list[str] | None = None, report: Callable[[str], None] = print) -> None:
    args = parse(argv)
    env = environment()
    result = asyncio.run(main(args))
    md = render(result["summary"], args, env)
    if "in_place" in result:
        md += render_in_place(result["in_place"], args)
    report(md)
    if not args.no_save:
        save("lua_parts", {"environment": env, "args": vars(args), **result}, md)


if __name__ == "__main__":
    run()
