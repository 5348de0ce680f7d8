"""Process snapshots: what every jobtier process publishes to Redis, and how it is read back.

Every process keeps its counters in memory and writes a snapshot to the hash ``jt:metrics``
every couple of seconds (``MetricsPublisher``). Readers take every live process's latest
snapshot; each series stays labelled with its ``process``, so a restart is that series'
counter reset, not a drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import msgspec
from redis.exceptions import RedisError

from jobtier.core.keys import Keys
from jobtier.metrics.histogram import merge, minus
from jobtier.runtime.loop import every
from jobtier.runtime.stopping import bounded, stop_task
from jobtier.store.redis import RedisClient, read_live

log = logging.getLogger("jobtier.metrics")

PUBLISH_EVERY = 2.0
FRESH_SECONDS = 15.0  # a snapshot older than this belongs to a process that is gone
FORGET_SECONDS = 3600.0  # ... and is deleted from Redis after this long
# the roles a process publishes under (``jobtier <role>``; ``run`` is all of them in one)
ROLES = ("api", "worker", "scheduler", "persister", "dispatcher", "run")


class Snapshot(msgspec.Struct):
    """One process's metrics. ``counters``/``gauges``: name -> {label string: value}."""

    process: str
    role: str
    at: float
    counters: dict[str, dict[str, float]] = {}
    gauges: dict[str, dict[str, float]] = {}
    histograms: dict[str, dict[str, Any]] = {}


def labels(**kv: str) -> str:
    """A label set as a stable string key: ``type=echo`` (empty for none)."""
    return ",".join(f"{k}={v}" for k, v in sorted(kv.items()))


def parse_labels(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",")) if text else {}


def process_id(role: str) -> str:
    return f"{role}:{socket.gethostname()}:{os.getpid()}"


def process_host(process: str) -> str:
    """The host part of a ``process_id``."""
    return process.split(":")[1] if process.count(":") >= 2 else ""


def process_pid(process: str) -> str:
    """The pid part of a ``process_id``."""
    return process.split(":")[2] if process.count(":") >= 2 else ""


class Source(Protocol):
    """A part of a process that builds its own metrics snapshot (a worker, a persister…)."""

    def metrics(self) -> Snapshot: ...


class MetricsPublisher:
    """Writes this process's snapshot (its ``parts``' merged) to Redis every
    ``PUBLISH_EVERY`` seconds. Use as ``async with MetricsPublisher(...):`` around the
    process's life: it publishes a last time on the way out."""

    def __init__(self, redis: RedisClient, keys: Keys, role: str, parts: Sequence[Source]) -> None:
        self.redis = redis
        self.key = keys.metrics()
        self.role = role
        self.process = process_id(role)
        self.parts = list(parts)
        self._task: asyncio.Task[None] | None = None

    def snapshot(self) -> Snapshot:
        out = Snapshot(self.process, self.role, time.time())
        for part in self.parts:
            snap = part.metrics()
            out.counters.update(snap.counters)
            out.gauges.update(snap.gauges)
            out.histograms.update(snap.histograms)
        return out

    async def publish(self) -> None:
        await self.redis.hset(self.key, self.process, msgspec.json.encode(self.snapshot()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="jobtier-metrics")

    async def stop(self) -> None:
        """End the loop, then publish a last snapshot (given up if Redis does not take it in
        time: a restart must not hold up the process's exit)."""
        await stop_task(self._task, "metrics publisher")
        with contextlib.suppress(RedisError, OSError):
            await bounded("last metrics snapshot", self.publish())

    async def __aenter__(self) -> MetricsPublisher:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _loop(self) -> None:
        await every(PUBLISH_EVERY, self.publish, event="metrics_publish", log=log)


_snapshot_decoder = msgspec.json.Decoder(Snapshot)


async def read_snapshots(
    redis: RedisClient, keys: Keys, within: float = FRESH_SECONDS
) -> list[Snapshot]:
    """Every live process's latest snapshot (or, with ``within``, every one published that
    recently: ``jobtier check`` says when a gone process was last seen); forgets processes
    gone for an hour."""

    def seen(raw: bytes) -> tuple[Snapshot, float]:
        snap = _snapshot_decoder.decode(raw)
        return snap, snap.at

    return await read_live(redis, keys.metrics(), seen, within, FORGET_SECONDS)


def live_processes(snapshots: Iterable[Snapshot]) -> dict[str, float]:
    """Live processes by role, every known role included: a role with none is a 0, which an
    alert can see, rather than a series that is not there."""
    out = {labels(role=role): 0.0 for role in ROLES}
    for snap in snapshots:
        key = labels(role=snap.role)
        out[key] = out.get(key, 0.0) + 1
    return out


def totals(snapshots: Iterable[Snapshot]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Counters and histograms summed over processes and labels (for the dashboard)."""
    snapshots = list(snapshots)
    counters: dict[str, float] = defaultdict(float)
    for snap in snapshots:
        for name, series in snap.counters.items():
            counters[name] += sum(series.values())
    return dict(counters), merge(_process_totals(s) for s in snapshots)


class HistogramWindow:
    """Histograms over the last ``seconds``, from the processes' cumulative snapshots, fed one
    sample per dashboard frame.

    Per process (as Prometheus's ``rate()``): its latest totals minus those of its newest
    sample at least ``seconds`` old (or its first, for a process that appeared since), then
    summed. A process that stops publishing leaves without taking the others' counts with
    it; a bucket that went down counts 0.
    """

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds
        self._samples: deque[tuple[float, dict[str, dict[str, dict[str, Any]]]]] = deque()

    def observe(
        self, at: float, snapshots: Iterable[Snapshot]
    ) -> tuple[dict[str, dict[str, Any]], float | None]:
        """(the histograms of the window, its span in seconds); on the first sample there is
        no window yet: the totals since the processes started, and None."""
        current = {s.process: _process_totals(s) for s in snapshots}
        samples = self._samples
        samples.append((at, current))
        while len(samples) > 2 and samples[1][0] <= at - self.seconds:
            samples.popleft()
        if len(samples) == 1:
            return merge(current.values()), None
        deltas = []
        for process, hists in current.items():
            base = next(h for _, sample in samples if (h := sample.get(process)) is not None)
            deltas.append({name: minus(h, base.get(name)) for name, h in hists.items()})
        return merge(deltas), at - samples[0][0]


def _process_totals(snap: Snapshot) -> dict[str, dict[str, Any]]:
    """One process's histograms, summed over their labels."""
    return merge(
        {name: h} for name, per_label in snap.histograms.items() for h in per_label.values()
    )
