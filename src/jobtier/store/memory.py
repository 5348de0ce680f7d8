"""How full Redis is: ``used_memory / maxmemory`` from INFO memory, on every primary.

jobtier requires ``noeviction`` (store/fitness.py): past ``maxmemory`` Redis refuses every write,
transitions of running jobs included. Submits are what fills it, so the API refuses them
first, while there is still room for the jobs already accepted to finish (admission.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from jobtier.store.redis import RedisClient, info_of_primaries


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """The fullest primary's ``used_memory`` and ``maxmemory`` (bytes; 0: no limit)."""

    used: int
    maxmemory: int

    @property
    def ratio(self) -> float:
        """``used / maxmemory``, 0.0 when Redis has no limit (it then never refuses)."""
        return self.used / self.maxmemory if self.maxmemory > 0 else 0.0


async def redis_memory(redis: RedisClient) -> MemoryUse:
    """The primary nearest its limit (a cluster refuses writes as soon as one node is full)."""
    infos = await info_of_primaries(redis, "memory")
    uses = [MemoryUse(int(i.get("used_memory", 0)), int(i.get("maxmemory", 0))) for i in infos]
    return max(uses, key=lambda u: (u.ratio, u.used))
