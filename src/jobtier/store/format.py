"""The format scripts write job hashes in, and the switch to a newer one.

core/keys.py ("Job hashes") describes the three formats. Scripts read every one and write the
format a shard's ``jt:{s}:fmt`` names: ``"3"`` (the newest: no status document stored, it is
rendered when read), ``"2"``, else format 1. A jobtier from before a format cannot read it: one
from before format 2 would take a packed queued job for one in no state and drop it from its
ready list; one from before format 3 would find no status document for a new job. So a
deployment that holds jobs switches only when no such process is left:

* a Redis that holds no jobtier job yet (no shard has a transition log) is switched to the
  newest format by the first process that connects (``adopt``, from ``Queue.connect``);
* otherwise, after every process (API, worker, scheduler, persister, resolver, dispatcher)
  runs this jobtier, ``jobtier job-format --upgrade`` switches every shard (``upgrade``). Until then
  processes log at start which older format the deployment writes.

The switch is one-way: once a shard writes a format, a jobtier from before it must not run
against it again. ``jt:{s}:fmt`` set to ``"1"`` or ``"2"`` by hand holds a shard in that
format (no process switches it by itself; ``--upgrade`` does).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from jobtier.core.keys import Keys
from jobtier.store.redis import RedisClient

log = logging.getLogger("jobtier.store.format")

NEWEST = 3

# the values packed in the 'c' and 't' (format 3) or 's' (format 2) fields, in order, by their
# format-1 names
# (lib.lua C_PATTERN and S_PATTERN; a unit test keeps them in step)
C_FIELDS = ("type", "prio", "max_attempts", "created_iso", "queue", "ckey")
S_FIELDS = ("state", "version", "attempt", "updated", "run_at", "run_at_iso", "cancel",
            "lease_version", "lv", "lt", "worker")  # fmt: skip


def job_fields(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    """A job hash (HGETALL) as field name -> value, the small fields under their format-1
    names whichever format holds them ('' for an empty one)."""
    out = {k.decode(): v.decode(errors="surrogateescape") for k, v in raw.items()}
    for packed, names in (("c", C_FIELDS), ("s", S_FIELDS), ("t", S_FIELDS)):
        value = out.pop(packed, None)
        if value is not None:
            out.update(zip(names, value.split(" ", len(names) - 1), strict=True))
    return out


def small_fields(name: str) -> tuple[str, str, str]:
    """The fields of a job hash to HMGET for ``small_field(…, name)``."""
    return ("t", "s", name)


def small_field(values: Sequence[bytes | None], name: str) -> bytes | None:
    """One of a job's changing fields (S_FIELDS' ``name``) from an HMGET of
    ``small_fields(name)``, whichever format the hash is in: the packed value of format 3 or
    2 when there is one, else format 1's own field."""
    t, s, alone = values
    packed = t if t is not None else s
    if packed is None:
        return alone
    # split as job_fields does: the last value (the worker id) may hold spaces
    return packed.split(b" ", len(S_FIELDS) - 1)[S_FIELDS.index(name)]


async def formats(redis: RedisClient, keys: Keys) -> list[int]:
    """The format each shard's scripts write, shard by shard (1, 2 or 3)."""
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.get(keys.job_format(shard))
    return [_format(v) for v in await pipe.execute()]


def _format(mark: bytes | None) -> int:
    """What lib.lua writes for a shard's mark: '3', '2', anything else format 1."""
    return 3 if mark == b"3" else 2 if mark == b"2" else 1


async def upgrade(redis: RedisClient, keys: Keys) -> None:
    """Make every shard write the newest format (idempotent). Only once every process reads
    it."""
    await _mark(redis, keys, str(NEWEST))


async def hold(redis: RedisClient, keys: Keys, fmt: int = 1) -> None:
    """Keep every shard writing new jobs in format ``fmt`` (1 or 2): no process switches it
    by itself (``upgrade`` does). For a deployment that must stay readable by an older
    jobtier, before it ever switched: a job already in a newer format stays in it (scripts
    never move a job to an older format), and an older jobtier still cannot read it."""
    if fmt not in (1, 2):
        raise ValueError(f"a shard can be held in format 1 or 2, not {fmt!r}")
    await _mark(redis, keys, str(fmt))


async def _mark(redis: RedisClient, keys: Keys, value: str) -> None:
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.set(keys.job_format(shard), value)
    await pipe.execute()


async def adopt(redis: RedisClient, keys: Keys) -> int:
    """At a process's start: switch a Redis that holds no jobtier job yet to the newest
    format, and a shard a switched deployment added (more shards, a node replaced) to the
    format of the others. Returns the format the deployment writes (an older one is logged:
    ``jobtier job-format --upgrade`` once every process runs this jobtier).

    "No job yet": no shard's transition log ever had an entry (the persister and the
    dispatcher create the streams empty, for their consumer groups, before any job; entries
    the persister trimmed still count, by the stream's last id). That leaves one race: an
    older jobtier that starts on the same empty Redis at the same moment.
    Both would be new processes of a deployment that has never run a job, which a rolling
    upgrade does not produce."""
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.get(keys.job_format(shard))
        pipe.xinfo_stream(keys.log(shard))  # an error when there is no such stream
    replies = await pipe.execute(raise_on_error=False)
    marks = replies[0::2]
    logged = [
        isinstance(info, dict) and _id(info.get("last-generated-id")) != "0-0"
        for info in replies[1::2]
    ]
    present = {_format(v) for v in marks if v is not None}
    # a shard held by hand holds the deployment; with no mark at all, jobs written before
    # marks existed mean format 1, and none the newest
    fmt = min(present) if present else 1 if any(logged) else NEWEST
    missing = [shard for shard, v in enumerate(marks) if v is None]
    if fmt > 1 and missing:
        pipe = redis.pipeline(transaction=False)
        for shard in missing:
            pipe.set(keys.job_format(shard), str(fmt), nx=True)
        await pipe.execute()
        log.info("event=job_format format=%d switched=%d", fmt, len(missing))
    if fmt < NEWEST:
        log.warning(
            "event=job_format format=%d shards=%d: this deployment writes job hashes in "
            "format %d; once every process runs this jobtier, run `jobtier job-format "
            "--upgrade` (less Redis CPU, memory and append-only file per job)",
            fmt, keys.shards, fmt,
        )  # fmt: skip
    return fmt


def _id(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
