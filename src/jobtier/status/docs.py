"""Reading jobs' status documents from Redis.

A job hash stores no status document (core/keys.py, "Job hashes"): ``read_status.lua``
renders it from the job's fields (render.lua ``status_of``). Every reader of a job's document
in Redis goes through here (or through the status reader, ``status/reader.py``, which calls
the same script).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobtier.core.keys import Keys
from jobtier.store.redis import RedisClient
from jobtier.store.scripts import Script, run_scripts, run_scripts_each

READ_STATUS = Script("read_status")


def read_status_args(job_keys: Sequence[str], more: str = "") -> tuple[Any, ...]:
    """``read_status.lua``'s EVALSHA arguments (after the sha) for ``job_keys``."""
    return (len(job_keys), *job_keys, more)


async def read_docs(
    redis: RedisClient, keys: Keys, job_ids: Sequence[str], more: str = "", *, each: bool = False
) -> list[Any]:
    """(tenant, document) of each job, in order — (tenant, document, value of ``more``) when
    ``more`` names another field of the job hash ('payload', 'result') — with ``None`` for
    what Redis does not hold. One script call per shard, in one pipeline (one per node of a
    cluster). A failure is raised; with ``each``, a failed job's entry is the exception
    instead (the jobs of a cluster node that is down), the others' are read."""
    by_shard: dict[int, list[int]] = {}
    for index, job_id in enumerate(job_ids):
        by_shard.setdefault(keys.shard_of(job_id), []).append(index)
    groups = list(by_shard.items())
    calls = [
        (
            READ_STATUS,
            read_status_args([keys.job_in(shard, job_ids[i]) for i in at], more),
        )
        for shard, at in groups
    ]
    run = run_scripts_each if each else run_scripts
    replies = await run(redis, calls) if calls else []
    stride = 3 if more else 2
    out: list[Any] = [()] * len(job_ids)
    for (_, at), flat in zip(groups, replies, strict=True):
        for n, i in enumerate(at):
            out[i] = (
                flat
                if isinstance(flat, Exception)
                else tuple(flat[stride * n : stride * n + stride])
            )
    return out


async def read_doc(redis: RedisClient, keys: Keys, job_id: str, more: str = "") -> tuple[Any, ...]:
    """``read_docs`` of one job."""
    found: tuple[Any, ...] = (await read_docs(redis, keys, [job_id], more))[0]
    return found
