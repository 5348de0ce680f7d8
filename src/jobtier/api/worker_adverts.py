"""What an HTTP worker's task advert (``PUT /v1/worker/tasks``) may change in the catalogue.

The catalogue keeps one entry per type, the latest advert winning (engine/catalog.py). An
HTTP advert cannot say what only a Python task declares — its payloads are encrypted
(``@task(encrypt=True)``), its failures compensated (``on_failure``) — so it must not
replace a live Python worker's entry: the API would stop sealing the type's payloads, drop
its compensation, and take the HTTP advert's queue and schema until that worker's next full
heartbeat. Such an advert is refused (409, naming the type); over any other entry (a Python
worker gone, or HTTP workers only) it is written, keeping the entry's ``encrypt`` and
``on_failure``: an HTTP advert never switches them off.
"""

from __future__ import annotations

import time

import msgspec

from jobtier.api.problems import Problem
from jobtier.core.model import TaskAd
from jobtier.core.names import HTTP_WORKER_PREFIX
from jobtier.engine.queue import Queue
from jobtier.engine.queue_admin import WORKER_FRESH_SECONDS

_ad = msgspec.json.Decoder(TaskAd)
_seen = msgspec.json.Decoder(dict[str, object])


def not_encrypted(queue: Queue, names: list[str], field: str) -> None:
    """A 422 problem if one of ``names`` is an encrypted queue (``JOBTIER_ENCRYPTED_QUEUES``):
    its payloads are opened by Python workers only, and an HTTP claim that met one of its jobs
    would fail it for good (worker_routes.py: _refuse_sealed). ``field``: ``queues``, or a
    task's ``tasks[i].queue`` (``{i}`` replaced by the name's index)."""
    sealed = queue.settings.encrypted_queue_names()
    for i, name in enumerate(names):
        if name in sealed:
            where = field.format(i=i)
            raise Problem(
                422,
                "validation",
                f"{where}: {name!r} is an encrypted queue (JOBTIER_ENCRYPTED_QUEUES), whose "
                "payloads only Python workers open: an HTTP worker's claim would fail its jobs "
                "for good; serve it with Python workers",
                field=where,
            )


async def guarded(queue: Queue, ads: list[TaskAd]) -> list[TaskAd]:
    """``ads`` as they may be written: a 422 problem for a task of an encrypted queue, a 409
    for a type a live non-HTTP worker advertises; the current entries' ``encrypt`` and
    ``on_failure`` carried over."""
    if not ads:
        return ads
    not_encrypted(queue, [ad.queue for ad in ads], "tasks[{i}].queue")
    raw = await queue.redis.hmget(queue.keys.tasks(), [ad.type for ad in ads])
    current: dict[str, TaskAd] = {}
    for ad, value in zip(ads, raw, strict=True):
        if value is not None:
            try:
                current[ad.type] = _ad.decode(value)
            except msgspec.DecodeError:
                continue  # written by a newer jobtier: its own fields are not ours to keep
    others = {c.worker for c in current.values() if not c.worker.startswith(HTTP_WORKER_PREFIX)}
    live = await _live(queue, sorted(others))
    for i, ad in enumerate(ads):
        c = current.get(ad.type)
        if c is not None and c.worker in live:
            raise Problem(
                409,
                "conflict",
                f"task {ad.type} is advertised by a live Python worker ({c.worker}): an HTTP "
                "advert would replace its policy (encryption, compensation, queue, schema)",
                field=f"tasks[{i}].type",
            )
    return [_kept(ad, current.get(ad.type)) for ad in ads]


def _kept(ad: TaskAd, current: TaskAd | None) -> TaskAd:
    if current is None or not (current.encrypt or current.on_failure):
        return ad
    return msgspec.structs.replace(
        ad, encrypt=ad.encrypt or current.encrypt, on_failure=ad.on_failure or current.on_failure
    )


async def _live(queue: Queue, workers: list[str]) -> set[str]:
    """Which of ``workers`` advertised themselves lately (as ``live_workers`` counts them)."""
    if not workers:
        return set()
    raw = await queue.redis.hmget(queue.keys.workers(), workers)
    now = time.time()
    live = set()
    for worker, value in zip(workers, raw, strict=True):
        if value is None:
            continue
        try:
            seen = float(_seen.decode(value).get("seen_at") or 0)  # type: ignore[arg-type]
        except (msgspec.DecodeError, TypeError, ValueError):
            continue
        if now - seen <= WORKER_FRESH_SECONDS:
            live.add(worker)
    return live
