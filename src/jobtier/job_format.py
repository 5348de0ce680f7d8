"""The format scripts write job hashes in, and the switch from format 1 to format 2.

keys.py ("Job hashes") describes both formats. Scripts read either and write format 2 on a
shard whose ``jt:{s}:fmt`` is ``"2"``. A jobtier from before format 2 reads only format 1:
it would take a packed queued job for one in no state and drop it from its ready list. So a
deployment that holds jobs switches only when no such process is left:

* a Redis that holds no jobtier job yet (no shard has a transition log) is switched by the
  first process that connects (``adopt``, from ``Queue.connect``);
* otherwise, after every process (API, worker, scheduler, resolver) runs this jobtier,
  ``jobtier job-format --upgrade`` switches every shard (``upgrade``). Until then processes
  log at start that the deployment writes format 1.

The switch is one-way: once a shard writes format 2, a jobtier from before format 2 must not
run against it again. ``jt:{s}:fmt`` set to ``"1"`` by hand holds a shard in format 1 (no
process switches it by itself; ``--upgrade`` does).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from jobtier.connection import RedisClient
from jobtier.keys import Keys

log = logging.getLogger("jobtier.job_format")

NEWEST = 2

# the values packed in format 2's 'c' and 's' fields, in order, by their format-1 names
# (lib.lua C_PATTERN and S_PATTERN; a unit test keeps them in step)
C_FIELDS = ("type", "prio", "max_attempts", "created_iso", "queue", "ckey")
S_FIELDS = ("state", "version", "attempt", "updated", "run_at", "run_at_iso", "cancel",
            "lease_version", "lv", "lt", "worker")  # fmt: skip


def job_fields(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    """A job hash (HGETALL) as field name -> value, the small fields under their format-1
    names whichever format holds them ('' for an empty one)."""
    out = {k.decode(): v.decode(errors="surrogateescape") for k, v in raw.items()}
    for packed, names in (("c", C_FIELDS), ("s", S_FIELDS)):
        value = out.pop(packed, None)
        if value is not None:
            out.update(zip(names, value.split(" ", len(names) - 1), strict=True))
    return out


def small_field(packed: bytes | None, alone: bytes | None, name: str) -> bytes | None:
    """One of a job's changing fields (S_FIELDS' ``name``) from an HMGET of ``'s'`` and of
    ``name``, whichever format the hash is in: format 2's packed value when there is one,
    else format 1's own field."""
    if packed is None:
        return alone
    # split as job_fields does: the last value (the worker id) may hold spaces
    return packed.split(b" ", len(S_FIELDS) - 1)[S_FIELDS.index(name)]


async def formats(redis: RedisClient, keys: Keys) -> list[int]:
    """The format each shard's scripts write, shard by shard (1 or 2)."""
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.get(keys.job_format(shard))
    return [2 if v == b"2" else 1 for v in await pipe.execute()]


async def upgrade(redis: RedisClient, keys: Keys) -> None:
    """Make every shard write format 2 (idempotent). Only once every process reads it."""
    await _mark(redis, keys, "2")


async def hold(redis: RedisClient, keys: Keys) -> None:
    """Keep every shard in format 1: no process switches it by itself (``upgrade`` does).
    For a deployment that must stay readable by a jobtier from before format 2."""
    await _mark(redis, keys, "1")


async def _mark(redis: RedisClient, keys: Keys, value: str) -> None:
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.set(keys.job_format(shard), value)
    await pipe.execute()


async def adopt(redis: RedisClient, keys: Keys) -> int:
    """At a process's start: switch a Redis that holds no jobtier job yet to format 2, and a
    shard a switched deployment added (more shards, a node replaced) likewise. Returns the
    format the deployment writes: 2, or 1 (logged: ``jobtier job-format --upgrade`` once
    every process runs this jobtier).

    "No job yet": no shard's transition log ever had an entry (the persister and the
    dispatcher create the streams empty, for their consumer groups, before any job; entries
    the persister trimmed still count, by the stream's last id). That leaves one race: a
    jobtier from before format 2 that starts on the same empty Redis at the same moment.
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
    if b"1" in marks or (b"2" not in marks and any(logged)):
        log.warning(
            "event=job_format format=1 shards=%d: this deployment writes job hashes in "
            "format 1; once every process runs this jobtier, run `jobtier job-format "
            "--upgrade` (less Redis CPU and memory per job)",
            keys.shards,
        )
        return 1
    if all(v == b"2" for v in marks):
        return 2
    pipe = redis.pipeline(transaction=False)
    for shard, v in enumerate(marks):
        if v != b"2":
            pipe.set(keys.job_format(shard), "2", nx=True)
    await pipe.execute()
    log.info("event=job_format format=2 switched=%d", sum(v != b"2" for v in marks))
    return 2


def _id(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
