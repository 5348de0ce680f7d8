"""The job-hash format this jobtier reads, and the one-time move of older data into it.

core/keys.py ("Job hashes") describes the format: a job's small fields packed in ``c`` and
``t``, and no stored status document (readers render it from the fields). The scripts read
and write nothing else. Earlier jobtiers wrote two older formats (1: a field per value and
the document in ``doc``; 2: ``c``, ``s`` and ``doc``), which ``jt:{s}:fmt`` ("1", "2", or no
mark at all) names, and kept ready jobs, before named queues, in ``jt:{s}:q:<priority>``.
So:

* ``adopt``, as every process starts (``Store.connect``), marks the shards of a Redis that
  holds no job ``"3"`` and done (``jt:{s}:fmt:done``), and refuses (``ConfigError``) a
  deployment that holds what this jobtier cannot read, or may (a shard marked "3" by an
  earlier jobtier, not yet looked over), naming ``jobtier job-format --upgrade``;
* ``upgrade`` (that command) rewrites every older job hash into format 3 and moves the old
  ready lists (``store/lua/reformat.lua``), marks every shard ``"3"``, looks the hashes over
  once more, and only then marks the shards done: a process of this jobtier never starts on
  a shard that may still hold an older hash. A process of the jobtier just before this one
  reads format 3 too, and writes it once its shard is marked: it may keep running
  meanwhile. One from before format 3 must be stopped first.
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
from jobtier.core.model import PRIORITIES
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
    done: bool  # jt:{s}:fmt:done: no hash in an older format is left
    logged: bool  # its transition log has had an entry (trimmed ones count)
    old_ready: int  # jobs in its ready lists from before named queues

    @property
    def new(self) -> bool:
        """It holds no job (its marks are set at the first process's start)."""
        return (self.mark is None or self.mark == MARK) and not self.logged and not self.old_ready

    @property
    def readable(self) -> bool:
        return ((self.mark == MARK and self.done) or self.new) and not self.old_ready

    def problems(self) -> list[str]:
        """Why this jobtier cannot read the shard (none when it can)."""
        out = []
        if self.mark is None and self.logged:
            out.append("jobs from before format marks (format 1)")
        elif self.mark is not None and self.mark != MARK:
            # what the scripts of the jobtiers that wrote it made of the mark
            out.append(f"job hashes in format {2 if self.mark == '2' else 1}")
        elif self.mark == MARK and not self.done and self.logged:
            out.append("marked format 3 by an earlier jobtier, not yet looked over")
        if self.old_ready:
            out.append("ready lists from before named queues")
        return out


async def shard_states(redis: RedisClient, keys: Keys) -> list[ShardState]:
    """Every shard's mark, whether its log ever had an entry, and its old ready jobs: one
    pipeline."""
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.get(keys.job_format(shard))
        pipe.exists(keys.format_done(shard))
        pipe.xinfo_stream(keys.log(shard))  # "no such key" when there is no such stream
        for key in old_ready(keys, shard):
            pipe.llen(key)
    replies = await pipe.execute(raise_on_error=False)
    width = 3 + len(PRIORITIES)
    out = []
    for shard in range(keys.shards):
        mark, done, info, *lengths = replies[shard * width : (shard + 1) * width]
        for reply in (mark, done, *lengths):
            if isinstance(reply, Exception):
                raise reply
        if isinstance(info, Exception) and "no such key" not in str(info).lower():
            raise info  # a refusal (an ACL, a key of another type) says nothing of the jobs
        # "No job yet": the persister and the dispatcher create the log streams empty, for
        # their consumer groups, before any job; entries since trimmed count, by the last id
        logged = isinstance(info, dict) and _text(info.get("last-generated-id")) != "0-0"
        lengths_sum = sum(int(n) for n in lengths)
        mark_text = None if mark is None else _text(mark)
        out.append(ShardState(shard, mark_text, bool(done), logged, lengths_sum))
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
    new = [s.shard for s in states if s.new and (s.mark != MARK or not s.done)]
    if new:
        await mark(redis, keys, new)
        log.info("event=job_format format=%d marked=%d", NEWEST, len(new))
    found = problems_by_kind(states)
    if found:
        what = "; ".join(f"{shard_list(shards)}: {p}" for p, shards in found.items())
        raise ConfigError(
            f"Redis holds job data this jobtier cannot read ({what}). Run `{COMMAND}` once "
            f"(it rewrites it into format {NEWEST}), then start this process again."
        )


async def unmarked(redis: RedisClient, keys: Keys) -> list[int]:
    """The shards without a format mark: on a deployment that has run (every process marks
    a new Redis as it starts), those whose Redis lost its data (restarted without it)."""
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.exists(keys.job_format(shard))
    return [shard for shard, found in enumerate(await pipe.execute()) if not found]


async def mark(redis: RedisClient, keys: Keys, shards: Sequence[int] | None = None) -> None:
    """Mark ``shards`` (every one by default) format 3, and done: they hold no older hash."""
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards) if shards is None else shards:
        pipe.set(keys.job_format(shard), MARK)
        pipe.set(keys.format_done(shard), "1")
    await pipe.execute()


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


async def _job_keys(redis: RedisClient, keys: Keys) -> AsyncIterator[tuple[int, list[Any]]]:
    """(shard, a batch of its job hash keys): one SCAN over every shard's job keys (on a
    cluster, one per primary node)."""
    nodes: list[dict[str, Any]] = [{}]
    if isinstance(redis, RedisCluster):
        await redis.initialize()
        nodes = [{"target_nodes": node} for node in redis.get_primaries()]
    prefix = f"{keys.prefix}:{{"
    pattern = _glob(prefix) + "*}:job:*"
    for where in nodes:
        batches: dict[int, list[Any]] = {}
        async for key in redis.scan_iter(match=pattern, count=1000, **where):
            text = key.decode() if isinstance(key, bytes) else key
            shard_text = text[len(prefix) :].split("}", 1)[0]
            if not shard_text.isdigit() or int(shard_text) >= keys.shards:
                continue  # another deployment's prefix that the pattern also matched
            batch = batches.setdefault(int(shard_text), [])
            batch.append(key)
            if len(batch) >= BATCH:
                yield int(shard_text), batches.pop(int(shard_text))
        for shard, batch in batches.items():
            yield shard, batch


async def _rewrite(scripts: Scripts) -> tuple[int, int]:
    """Rewrite the job hashes from before format 3 (and fill a job's ``lv`` an earlier
    jobtier left empty): (rewritten, documents that differ)."""
    rewritten = differ = 0
    async for shard, batch in _job_keys(scripts.redis, scripts.keys):
        reply = await scripts.call("reformat", shard, (0, len(batch), *batch))
        rewritten, differ = rewritten + int(reply[0]), differ + int(reply[1])
    return rewritten, differ


async def upgrade(redis: RedisClient, keys: Keys) -> Upgraded:
    """Rewrite every job hash of formats 1 and 2 into format 3, move the ready lists from
    before named queues into today's, then mark every shard "3" (``jobtier job-format
    --upgrade``). Idempotent: what is done already is left as it is, so a second run (or one
    after a run that stopped half-way) changes nothing more than what is left.

    After the marks, the hashes are looked over once more (a process of the jobtier before
    this one, still running, wrote its shard's older format until the mark changed), and only
    then are the shards marked done."""
    scripts = Scripts(redis, keys)
    hashes, differ = await _rewrite(scripts)
    moved = dropped = 0
    for shard in range(keys.shards):
        while True:
            reply = await scripts.call("reformat", shard, (1000, 0))
            done, off, n, taken, left = (int(x) for x in reply)
            hashes, differ = hashes + done, differ + off
            moved, dropped = moved + n, dropped + taken - n
            if not left or not taken:
                break
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.set(keys.job_format(shard), MARK)
    await pipe.execute()
    done, off = await _rewrite(scripts)
    hashes, differ = hashes + done, differ + off
    await mark(redis, keys)  # only now may a process of this jobtier start on them
    result = Upgraded(hashes, differ, moved, dropped, keys.shards)
    log.info(
        "event=job_format_upgraded hashes=%d differ=%d moved=%d dropped=%d shards=%d",
        *(result.hashes, result.differ, result.moved, result.dropped, result.shards),
    )
    return result
