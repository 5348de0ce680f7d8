"""Which HTTP workers are live: the workers hash's entry of each (``http:<worker>``), as
``QueueAdmin.live_workers``, the console, ``explain`` and queue scaling read it. A claim
writes it (what the worker serves), a heartbeat keeps it fresh, a leave removes it; a worker
that goes without leaving drops out a minute after it was last seen
(``WORKER_FRESH_SECONDS``)."""

from __future__ import annotations

import logging
import time

import msgspec
from starlette.requests import Request

from jobtier.api.worker_bodies import ADVERTISE_EVERY, ADVERTISED_KEPT, ClaimRequest
from jobtier.api.worker_claims import WorkerClaims
from jobtier.core.model import encode_json
from jobtier.engine.queue import Queue
from jobtier.runtime.loop import FAULTS
from jobtier.store.faults import fault_event

log = logging.getLogger("jobtier.api.worker")


async def advertise(
    request: Request, claims: WorkerClaims, worker: str, body: ClaimRequest
) -> None:
    """The worker is live (``QueueAdmin.live_workers``, the console, ``explain``): written
    at its claims, at most every ``ADVERTISE_EVERY`` seconds."""
    now = time.time()
    if now - claims.advertised.get(worker, 0.0) < ADVERTISE_EVERY:
        return
    if len(claims.advertised) > ADVERTISED_KEPT:  # workers come and go (ids with a pid)
        claims.advertised.clear()
    claims.advertised[worker] = now
    client = request.client
    info = {
        "id": worker, "pid": 0, "host": client.host if client else "",
        # its slots: those it asks to fill and those in use (a claim asks for the free ones)
        "concurrency": body.count + body.running, "running": body.running,
        "tasks": body.types, "queues": body.queues, "seen_at": now,
    }  # fmt: skip
    queue: Queue = request.state.queue
    await queue.redis.hset(queue.keys.workers(), worker, encode_json(info))


async def still_live(request: Request, worker: str) -> None:
    """A worker whose slots are all busy claims nothing, yet it is live: its heartbeats say
    so. The advert its last claim wrote gets a fresh ``seen_at``, at most every
    ``ADVERTISE_EVERY`` seconds (a worker never advertised, or forgotten, waits for its next
    claim: only a claim says what it serves)."""
    claims: WorkerClaims = request.state.worker_claims
    now = time.time()
    if now - max(claims.seen.get(worker, 0.0), claims.advertised.get(worker, 0.0)) < (
        ADVERTISE_EVERY
    ):
        return
    if len(claims.seen) > ADVERTISED_KEPT:
        claims.seen.clear()
    claims.seen[worker] = now  # (a claim's own advert is not held back by it)
    queue: Queue = request.state.queue
    try:
        raw = await queue.redis.hget(queue.keys.workers(), worker)
        if raw is None:
            return
        info = msgspec.json.decode(raw)
        info["seen_at"] = now
        # (a claim's advert written meanwhile may be overwritten by its older self: the
        # worker's next claim writes it again)
        await queue.redis.hset(queue.keys.workers(), worker, encode_json(info))
    except FAULTS as exc:  # the heartbeat itself was applied: its answer still goes out
        log.info("event=worker_seen_not_written worker=%s error=%s", worker, fault_event(exc))


async def forget(request: Request, worker: str) -> bool:
    """The worker left: its entry goes now (True if there was one), and this process's
    memory of its adverts with it (its next claim, if it comes back, advertises at once)."""
    claims: WorkerClaims = request.state.worker_claims
    claims.advertised.pop(worker, None)
    claims.seen.pop(worker, None)
    queue: Queue = request.state.queue
    removed = bool(await queue.redis.hdel(queue.keys.workers(), worker))
    log.info("event=http_worker_left worker=%s listed=%s", worker, removed)
    return removed
