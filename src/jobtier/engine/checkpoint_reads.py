"""Reading a job's last checkpoint (``ctx.checkpoint``) from Redis.

The state lives in the job's hash ('cp', with 'cpm' what the status document shows of it:
heartbeat.lua), as long as the job does there; Postgres keeps every state saved
(``job_checkpoints``) for after.
"""

from __future__ import annotations

import msgspec

from jobtier.core.model import CheckpointMark
from jobtier.store.context import Store


async def read_checkpoint(store: Store, job_id: str) -> tuple[bytes, CheckpointMark] | None:
    """(state as JSON, its mark) of the job's last checkpoint while Redis holds the job, or
    None (no checkpoint, or no such job in Redis: the caller checked who owns it)."""
    key = store.keys.job_in(store.keys.shard_of(job_id), job_id)
    state, mark = await store.redis.hmget(key, ["cp", "cpm"])
    if state is None or mark is None:
        return None
    data = state if isinstance(state, bytes) else state.encode()
    return data, msgspec.json.decode(mark, type=CheckpointMark)
