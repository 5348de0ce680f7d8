"""The job-hash format this jobtier reads, and the one-time move of older data into it.

core/keys.py ("Job hashes") describes the format: a job's small fields packed in ``c`` and
``t``, and no stored status document (readers render it from the fields). The scripts read
and write nothing else. Earlier jobtiers wrote two older formats (1: a field per value and
the document in ``doc``; 2: ``c``, ``s`` and ``doc``), which ``jt:{s}:fmt`` ("1", "2", or no
mark at all) names, and kept ready jobs, before named queues, in ``jt:{s}:q:<priority>``.
So:

* ``adopt``, as every process starts (``Queue.connect``), marks the shards of a Redis that
  never held a job ``"3"``, and refuses (``ConfigError``) a deployment that holds what this
  jobtier cannot read, naming ``jobtier job-format --upgrade``;
* ``upgrade`` (that command) rewrites every older job hash into format 3 and moves the old
  ready lists (``store/lua/reformat.lua``), then marks every shard ``"3"``. A process of the
  jobtier just before this one reads format 3 too, and writes it once its shard is marked:
  it may keep running meanwhile. One from before format 3 must be stopped first.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

from jobtier.core.errors import ConfigError
from jobtier.core.keys import Keys
from jobtier.store.redis import RedisClient
from jobtier.store.scripts import Scripts

log = logging.getLogger("jobtier.store.format")

NEWEST = 3
MARK = str(NEWEST)  # jt:{s}:fmt of a shard this jobtier reads
COMMAND = "jobtier job-format --upgrade"

# the values packed in 'c' and 't', in order (lib.lua C_PATTERN and T_PATTERN; a unit test
# keeps them in step)
C_FIELDS = ("type", "prio", "max_attempts", "created_iso", "queue", "ckey")
T_FIELDS = (
    "state",
    "version",
    "attempt",
    "updated",
    "run_at",
    "run_at_iso",
    "cancel",
    "lease_version",
    "lv",
    "lt",
    "worker",
)

PRIORITIES = ("critical", "high", "normal", "low")


def job_fields(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    """A job hash (HGETALL) as field name -> value, its packed values under their own names
    ('' for an empty one)."""
    out = {k.decode(): v.decode(errors="surrogateescape") for k, v in raw.items()}
    for packed, names in (("c", C_FIELDS), ("t", T_FIELDS)):
        value = out.pop(packed, None)
        if value is not None:
            out.update(zip(names, value.split(" ", len(names) - 1), strict=True))
    return out


def small_fields(name: str) -> tuple[str]:
    """The field of a job hash to HMGET for ``small_field(…, name)``: the packed value that
    holds ``name`` (of C_FIELDS or T_FIELDS)."""
    return ("c",) if name in C_FIELDS else ("t",)


def small_field(values: Sequence[bytes | None], name: str) -> bytes | None:
    """One of a job's packed values (``name``) from an HMGET of ``small_fields(name)``; None
    for no such job."""
    packed = values[0]
    if packed is None:
        return None
    names = C_FIELDS if name in C_FIELDS else T_FIELDS
    # the last value (a concurrency key, a worker id) may hold spaces
    return packed.split(b" ", len(names) - 1)[names.index(name)]


# --- what a deployment holds ----------------------------------------------------------------
def old_ready(keys: Keys, shard: int) -> list[str]:
    """The shard's ready lists from before named queues, one per priority."""
    return [f"{keys.base(shard)}q:{p}" for p in PRIORITIES]


@dataclass(frozen=True, slots=True)
class ShardState:
    shard: int
    mark: str | None  # jt:{s}:fmt
    logged: bool  # its transition log has had an entry (trimmed ones count)
    old_ready: int  # jobs in its ready lists from before named queues

    @property
    def new(self) -> bool:
        """It never held a job (its mark is set at the first process's start)."""
        return self.mark is None and not self.logged and not self.old_ready

    @property
    def readable(self) -> bool:
        return (self.mark == MARK or self.new) and not self.old_ready

    def problems(self) -> list[str]:
        """Why this jobtier cannot read the shard (none when it can)."""
        out = []
        if self.mark is None and self.logged:
            out.append("jobs from before format marks (format 1)")
        elif self.mark is not None and self.mark != MARK:
            # what the scripts of the jobtiers that wrote it made of the mark
            out.append(f"job hashes in format {2 if self.mark == '2' else 1}")
        if self.old_ready:
            out.append("ready lists from before named queues")
        return out


async def shard_states(redis: RedisClient, keys: Keys) -> list[ShardState]:
    """Every shard's mark, whether its log ever had an entry, and its old ready jobs: one
    pipeline."""
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.get(keys.job_format(shard))
        pipe.xinfo_stream(keys.log(shard))  # an error when there is no such stream
        for key in old_ready(keys, shard):
            pipe.llen(key)
    replies = await pipe.execute(raise_on_error=False)
    width = 2 + len(PRIORITIES)
    out = []
    for shard in range(keys.shards):
        mark, info, *lengths = replies[shard * width : (shard + 1) * width]
        for reply in (mark, *lengths):
            if isinstance(reply, Exception):
                raise reply
        # "No job yet": the persister and the dispatcher create the log streams empty, for
        # their consumer groups, before any job; entries since trimmed count, by the last id
        logged = isinstance(info, dict) and _text(info.get("last-generated-id")) != "0-0"
        out.append(
            ShardState(
                shard, None if mark is None else _text(mark), logged, sum(int(n) for n in lengths)
            )
        )
    return out


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def shard_list(shards: Sequence[int]) -> str:
    """'shard 3', 'shards 0-5, 9'."""
    runs: list[list[int]] = []
    for s in sorted(shards):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("shard " if len(shards) == 1 else "shards ") + text


def problems_by_kind(states: Sequence[ShardState]) -> dict[str, list[int]]:
    """What makes shards unreadable -> the shards it concerns."""
    out: dict[str, list[int]] = {}
    for state in states:
        for problem in state.problems():
            out.setdefault(problem, []).append(state.shard)
    return out


async def adopt(redis: RedisClient, keys: Keys) -> None:
    """At a process's start: check that this jobtier can read the deployment, or refuse.

    A shard that never held a job (no mark, and no entry ever in its transition log) is
    marked format 3. A shard marked "1" or "2", or unmarked but with logged jobs (a
    deployment from before marks: format 1), or that still holds ready lists from before
    named queues raises ``ConfigError`` naming the shards and ``jobtier job-format
    --upgrade``. One race is left: a jobtier from before format 3 that starts on the same
    empty Redis at the same moment, which a deployment that has never run a job does not
    produce."""
    states = await shard_states(redis, keys)
    new = [s.shard for s in states if s.new]
    if new:
        pipe = redis.pipeline(transaction=False)
        for shard in new:
            pipe.set(keys.job_format(shard), MARK, nx=True)
        await pipe.execute()
        log.info("event=job_format format=%d marked=%d", NEWEST, len(new))
    found = problems_by_kind(states)
    if found:
        what = "; ".join(f"{shard_list(shards)}: {p}" for p, shards in found.items())
        raise ConfigError(
            f"Redis holds job data this jobtier cannot read ({what}). Run `{COMMAND}` once "
            f"(it rewrites it into format {NEWEST}), then start this process again."
        )


# --- the upgrade ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Upgraded:
    """What ``upgrade`` did."""

    hashes: int  # job hashes rewritten into format 3
    differ: int  # of them, those whose rendered document is not the one they stored
    moved: int  # jobs moved from the ready lists of before named queues
    dropped: int  # ids taken from those lists whose job was no longer queued (or gone)
    shards: int  # shards marked format 3


BATCH = 500  # job keys per reformat.lua call


def _glob(text: str) -> str:
    """``text`` matched literally in a SCAN pattern (a prefix may hold *, ?, [ or \\)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


async def _job_keys(redis: RedisClient, keys: Keys, shard: int) -> AsyncIterator[list[Any]]:
    """The shard's job hash keys, in batches: SCAN over its hash tag (on a cluster, on the
    node that holds the shard only)."""
    where: dict[str, Any] = {}
    if isinstance(redis, RedisCluster):
        await redis.initialize()
        where["target_nodes"] = redis.get_node_from_key(keys.log(shard))
    batch: list[Any] = []
    async for key in redis.scan_iter(match=_glob(keys.base(shard)) + "job:*", count=1000, **where):
        batch.append(key)
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


async def _rewrite(scripts: Scripts, shard: int) -> tuple[int, int]:
    """Rewrite the shard's job hashes from before format 3: (rewritten, documents that
    differ)."""
    rewritten = differ = 0
    async for batch in _job_keys(scripts.redis, scripts.keys, shard):
        reply = await scripts.call(scripts["reformat"], shard, (0, len(batch), *batch))
        rewritten, differ = rewritten + int(reply[0]), differ + int(reply[1])
    return rewritten, differ


async def upgrade(redis: RedisClient, keys: Keys) -> Upgraded:
    """Rewrite every job hash of formats 1 and 2 into format 3, move the ready lists from
    before named queues into today's, then mark every shard "3" (``jobtier job-format
    --upgrade``). Idempotent: what is done already is left as it is, so a second run (or one
    after a run that stopped half-way) changes nothing more than what is left.

    After the marks, the hashes are looked over once more: a process of the jobtier before
    this one, still running, wrote its shard's older format until the mark changed."""
    scripts = Scripts(redis, keys)
    hashes = differ = moved = dropped = 0
    for shard in range(keys.shards):
        done, off = await _rewrite(scripts, shard)
        hashes, differ = hashes + done, differ + off
        while True:
            reply = await scripts.call(scripts["reformat"], shard, (1000, 0))
            done, off, n, taken, left = (int(x) for x in reply)
            hashes, differ = hashes + done, differ + off
            moved, dropped = moved + n, dropped + taken - n
            if not left or not taken:
                break
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.set(keys.job_format(shard), MARK)
    await pipe.execute()
    for shard in range(keys.shards):
        done, off = await _rewrite(scripts, shard)
        hashes, differ = hashes + done, differ + off
    result = Upgraded(hashes, differ, moved, dropped, keys.shards)
    log.info(
        "event=job_format_upgraded hashes=%d differ=%d moved=%d dropped=%d shards=%d",
        *(result.hashes, result.differ, result.moved, result.dropped, result.shards),
    )
    return result
