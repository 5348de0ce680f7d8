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
from jobtier.store.scripts import Script, run_scripts

READ_STATUS = Script("read_status")


def read_status_args(job_keys: Sequence[str], more: str = "") -> tuple[Any, ...]:
    """``read_status.lua``'s EVALSHA arguments (after the sha) for ``job_keys``."""
    return (len(job_keys), *job_keys, more)


async def read_docs(
    redis: RedisClient, keys: Keys, job_ids: Sequence[str], more: str = ""
) -> list[tuple[Any, ...]]:
    """(tenant, document) of each job, in order — (tenant, document, value of ``more``) when
    ``more`` names another field of the job hash ('payload', 'result') — with ``None`` for
    what Redis does not hold. One script call per shard, in one pipeline."""
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
    replies = await run_scripts(redis, calls) if calls else []
    stride = 3 if more else 2
    out: list[tuple[Any, ...]] = [()] * len(job_ids)
    for (_, at), flat in zip(groups, replies, strict=True):
        for n, i in enumerate(at):
            out[i] = tuple(flat[stride * n : stride * n + stride])
    return out


async def read_doc(redis: RedisClient, keys: Keys, job_id: str, more: str = "") -> tuple[Any, ...]:
    """``read_docs`` of one job."""
    return (await read_docs(redis, keys, [job_id], more))[0]
