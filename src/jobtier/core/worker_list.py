"""The live workers as the API lists them (``GET /v1/admin/workers``: the console, the
clients' ``workers()``, ``jobtier workers``)."""

from __future__ import annotations

import msgspec


class RunningJob(msgspec.Struct):
    id: str
    tenant: str
    type: str
    queue: str
    attempt: int
    since: str  # when it was claimed (its status document's updated_at, or the last change)


class WorkerInfo(msgspec.Struct):
    """A live worker as it advertises itself (every third of a lease), and the jobs Redis
    says it runs now."""

    id: str
    host: str
    pid: int
    queues: list[str]
    tasks: list[str]
    concurrency: int
    running: int  # as the worker counted at its last heartbeat
    seen_at: float  # Unix time of its last heartbeat
    jobs: list[RunningJob]


class WorkerList(msgspec.Struct):
    workers: list[WorkerInfo]
    running_total: int  # jobs running now, by the shards' lease sets
    running_listed: int  # of which listed under their workers (at most RUNNING_SHOWN a shard)
