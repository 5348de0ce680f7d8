"""Metrics: every process publishes through Redis; the API serves them all at ``/metrics``.

Workers, schedulers, persisters and API processes each keep their counters in memory and
write a snapshot to the hash ``jt:metrics`` every couple of seconds (``MetricsPublisher``).
Any API process renders, at scrape time, every live process's snapshot — each series labelled
with its ``process``, so Prometheus sees a restart as that series' counter reset — plus the
gauges read from Redis right then (queue depths, oldest waiting job, dead letters, live
workers, write-behind lag). One scrape target shows the whole deployment, however many API
server processes share the port, and the dashboard reads the same snapshots.

Job counters by type come from the transition log: the persister sees every transition
once, so ``TransitionCounter`` (fed by its commits) counts submitted / claimed / succeeded /
failed / retried / dead-lettered / cancelled jobs and lease expirations exactly, whichever
process made them.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import socket
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from redis.exceptions import RedisError

from jobtier.connection import RedisClient
from jobtier.keys import Keys

log = logging.getLogger("jobtier.metrics")

PUBLISH_EVERY = 2.0
FRESH_SECONDS = 15.0  # a snapshot older than this belongs to a process that is gone
FORGET_SECONDS = 3600.0  # ... and is deleted from Redis after this long
SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
    1800,
    3600,
)
SIZE_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 2000, 5000)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics), cheap to observe."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = SECONDS_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "bounds": self.bounds,
            "counts": list(self.counts),
            "sum": self.sum,
            "count": self.count,
        }


def quantile(hist: dict[str, Any], q: float) -> float | None:
    """Estimated ``q`` quantile of a histogram snapshot: the upper bound of its bucket (the
    largest finite bound when it falls past them: a lower bound then). None without data."""
    total = hist["count"]
    if not total:
        return None
    rank = q * total
    seen = 0
    for bound, n in zip(hist["bounds"], hist["counts"], strict=False):
        seen += n
        if seen >= rank:
            return float(bound)
    return float(hist["bounds"][-1])


class HistogramWindow:
    """Histograms over the last ``seconds``, from the processes' cumulative snapshots, fed one
    sample per dashboard frame.

    Per process (as Prometheus's ``rate()`` works per series): its latest totals minus those
    of its newest sample at least ``seconds`` old, or of its first sample when it appeared
    later; then summed. A process that appears (a new worker, a restart: the process id
    carries the pid) counts from its first sample, not its whole life; one that stops
    publishing leaves without taking the others' counts with it. A bucket that went down
    counts 0.
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
            return _sum(current.values()), None
        deltas = []
        for process, hists in current.items():
            base = next(h for _, sample in samples if (h := sample.get(process)) is not None)
            deltas.append({name: _minus(h, base.get(name)) for name, h in hists.items()})
        return _sum(deltas), at - samples[0][0]


def _process_totals(snap: Snapshot) -> dict[str, dict[str, Any]]:
    """One process's histograms, summed over their labels."""
    return _sum(
        {name: h} for name, per_label in snap.histograms.items() for h in per_label.values()
    )


def _sum(parts: Iterable[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, h in part.items():
            acc = out.get(name)
            if acc is None:
                out[name] = {
                    "bounds": h["bounds"], "counts": list(h["counts"]),
                    "sum": h["sum"], "count": h["count"],
                }  # fmt: skip
            elif list(acc["bounds"]) == list(h["bounds"]):
                acc["counts"] = [a + b for a, b in zip(acc["counts"], h["counts"], strict=True)]
                acc["sum"] += h["sum"]
                acc["count"] += h["count"]
    return out


def _minus(h: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    if base is None:
        return h
    if list(base["bounds"]) != list(h["bounds"]):
        return {"bounds": h["bounds"], "counts": [0] * len(h["counts"]), "sum": 0.0, "count": 0}
    counts = [max(0, a - b) for a, b in zip(h["counts"], base["counts"], strict=True)]
    return {
        "bounds": h["bounds"],
        "counts": counts,
        "sum": max(0.0, h["sum"] - base["sum"]),
        "count": sum(counts),
    }


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


class TransitionCounter:
    """Counts jobs by type and outcome from persisted transitions (the persister's commits)."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def observe(self, entries: Iterable[Any], _wall: float = 0.0) -> None:
        counts = self.counts
        for entry in entries:
            doc = entry.status
            kind = labels(type=doc.type)
            to, frm = doc.state.value, entry.from_state
            counts["transitions_persisted_total"][""] += 1
            if frm is None:
                counts["jobs_submitted_total"][kind] += 1
            elif frm == "queued" and to == "running":
                counts["jobs_claimed_total"][kind] += 1
            elif frm == "running" and to != "running":
                expired = doc.error is not None and doc.error.type == "LeaseExpired"
                if expired and to in ("queued", "failed"):
                    counts["lease_expirations_total"][kind] += 1
                if to == "succeeded":
                    counts["jobs_succeeded_total"][kind] += 1
                elif to == "scheduled":
                    counts["jobs_failed_total"][kind] += 1
                    counts["jobs_retried_total"][kind] += 1
                elif to == "failed" and not expired:
                    counts["jobs_failed_total"][kind] += 1
            if to == "failed" and frm != "failed":
                counts["jobs_dead_lettered_total"][kind] += 1
            if to == "cancelled":
                counts["jobs_cancelled_total"][kind] += 1


def process_id(role: str) -> str:
    return f"{role}:{socket.gethostname()}:{os.getpid()}"


def process_host(process: str) -> str:
    """The host part of a ``process_id``."""
    return process.split(":")[1] if process.count(":") >= 2 else ""


class MetricsPublisher:
    """Writes this process's snapshot to Redis every ``PUBLISH_EVERY`` seconds.

    ``sources`` are callables returning partial snapshots (counters, gauges, histograms):
    one per part running in the process (`jobtier run` hosts them all).
    """

    def __init__(
        self, redis: RedisClient, keys: Keys, role: str, sources: list[Callable[[], Snapshot]]
    ) -> None:
        self.redis = redis
        self.key = keys.metrics()
        self.role = role
        self.process = process_id(role)
        self.sources = sources
        self._task: asyncio.Task[None] | None = None

    def snapshot(self) -> Snapshot:
        out = Snapshot(self.process, self.role, time.time())
        for source in self.sources:
            part = source()
            out.counters.update(part.counters)
            out.gauges.update(part.gauges)
            out.histograms.update(part.histograms)
        return out

    async def publish(self) -> None:
        await self.redis.hset(self.key, self.process, msgspec.json.encode(self.snapshot()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="jobtier-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(RedisError, OSError):
            await self.publish()  # the final counts of a process that stops

    async def _loop(self) -> None:
        while True:
            try:
                await self.publish()
            except (RedisError, OSError) as exc:
                log.warning("event=metrics_publish_failed error=%r", exc)
            except Exception:
                log.exception("event=metrics_publish_failed")
            await asyncio.sleep(PUBLISH_EVERY)


_snapshot_decoder = msgspec.json.Decoder(Snapshot)


async def read_snapshots(redis: RedisClient, keys: Keys) -> list[Snapshot]:
    """Every live process's latest snapshot; forgets processes gone for an hour."""
    now = time.time()
    live, gone = [], []
    for field, raw in (await redis.hgetall(keys.metrics())).items():
        try:
            snap = _snapshot_decoder.decode(raw)
        except msgspec.DecodeError:
            gone.append(field)
            continue
        if now - snap.at <= FRESH_SECONDS:
            live.append(snap)
        elif now - snap.at > FORGET_SECONDS:
            gone.append(field)
    if gone:
        await redis.hdel(keys.metrics(), *gone)
    return live


def totals(snapshots: Iterable[Snapshot]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Counters and histograms summed over processes and labels (for the dashboard)."""
    snapshots = list(snapshots)
    counters: dict[str, float] = defaultdict(float)
    for snap in snapshots:
        for name, series in snap.counters.items():
            counters[name] += sum(series.values())
    return dict(counters), _sum(_process_totals(s) for s in snapshots)


HELP = {
    "jobs_submitted_total": "Jobs created (submit, batch submit, schedule firings).",
    "jobs_claimed_total": "Attempts started: queued -> running.",
    "jobs_succeeded_total": "Jobs that succeeded.",
    "jobs_failed_total": "Attempts that failed (retried or dead-lettered).",
    "jobs_retried_total": "Failed attempts scheduled to run again.",
    "jobs_dead_lettered_total": "Jobs that went to the dead-letter set.",
    "jobs_cancelled_total": "Jobs cancelled.",
    "lease_expirations_total": "Running jobs taken back after their worker stopped heartbeating.",
    "transitions_persisted_total": "Transitions written to Postgres.",
    "persister_bad_entries_total": "Log entries that could not be stored (unreadable or refused).",
    "persister_parked_total": "Log entries Postgres refused, moved to the shard's log:refused stream.",
}


class SnapshotCollector(Collector):
    """prometheus_client collector over the process snapshots and the live gauges."""

    def __init__(self, snapshots: list[Snapshot], gauges: dict[str, dict[str, float]]) -> None:
        self.snapshots = snapshots
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        counters: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        gauges: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        hists: dict[str, list[tuple[dict[str, str], dict[str, Any]]]] = defaultdict(list)
        for snap in self.snapshots:
            own = {"process": snap.process, "role": snap.role}
            for name, series in snap.counters.items():
                counters[name] += [({**own, **parse_labels(k)}, v) for k, v in series.items()]
            for name, series in snap.gauges.items():
                gauges[name] += [({**own, **parse_labels(k)}, v) for k, v in series.items()]
            for name, per_label in snap.histograms.items():
                hists[name] += [({**own, **parse_labels(k)}, h) for k, h in per_label.items()]
        for name, series in self.gauges.items():
            gauges[name] += [(parse_labels(k), v) for k, v in series.items()]
        for name, samples in sorted(counters.items()):
            names = _label_names(samples)
            family = CounterMetricFamily(
                f"jobtier_{name.removesuffix('_total')}", HELP.get(name, name), labels=names
            )
            for lv, value in samples:
                family.add_metric([lv.get(n, "") for n in names], value)
            yield family
        for name, samples in sorted(gauges.items()):
            names = _label_names(samples)
            g = GaugeMetricFamily(f"jobtier_{name}", HELP.get(name, name), labels=names)
            for lv, value in samples:
                g.add_metric([lv.get(n, "") for n in names], value)
            yield g
        for name, hsamples in sorted(hists.items()):
            names = _label_names(hsamples)
            h = HistogramMetricFamily(f"jobtier_{name}", HELP.get(name, name), labels=names)
            for lv, hist in hsamples:
                cumulative, buckets = 0, []
                for bound, n in zip([*hist["bounds"], float("inf")], hist["counts"], strict=True):
                    cumulative += n
                    buckets.append(
                        ("+Inf" if bound == float("inf") else repr(float(bound)), cumulative)
                    )
                h.add_metric([lv.get(n, "") for n in names], buckets, hist["sum"])
            yield h


def _label_names(samples: Sequence[tuple[dict[str, str], Any]]) -> list[str]:
    return sorted({name for lv, _ in samples for name in lv})


def render(snapshots: list[Snapshot], gauges: dict[str, dict[str, float]]) -> bytes:
    from prometheus_client import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshots, gauges))
    return generate_latest(registry)


# --- what each part publishes -------------------------------------------------------------------
def worker_source(worker: Worker) -> Callable[[], Snapshot]:
    def collect() -> Snapshot:
        st = worker.stats
        return Snapshot(
            "", "", 0.0,
            counters={
                "worker_jobs_started_total": {"": st.claimed},
                "worker_claim_round_trips_total": {"": st.claim_round_trips},
                "worker_outcomes_total": {
                    labels(outcome="succeeded"): st.succeeded, labels(outcome="retried"): st.retried,
                    labels(outcome="failed"): st.failed, labels(outcome="cancelled"): st.cancelled,
                    labels(outcome="released"): st.released,
                },
                "stale_writes_refused_total": {"": st.refused},
                "leases_lost_total": {"": st.leases_lost},
            },
            gauges={"worker_running_jobs": {"": len(worker._running)}, "worker_concurrency": {"": worker.concurrency}},
            histograms={
                "claim_wait_seconds": {"": st.claim_wait_hist.snapshot()},
                "run_time_seconds": {"": st.run_time_hist.snapshot()},
            },
        )  # fmt: skip

    return collect


def scheduler_source(scheduler: Scheduler) -> Callable[[], Snapshot]:
    def collect() -> Snapshot:
        st = scheduler.stats
        return Snapshot(
            "", "", 0.0,
            counters={
                "scheduler_promoted_total": {"": st.promoted},
                "scheduler_requeued_total": {"": st.requeued},
                "scheduler_dead_lettered_total": {"": st.dead},
                "schedule_firings_total": {"": st.fired},
                "scheduler_passes_total": {"": st.passes},
            },
        )  # fmt: skip

    return collect


def persister_source(persister: Persister, counter: TransitionCounter) -> Callable[[], Snapshot]:
    sizes = Histogram(SIZE_BUCKETS)
    seen = [0]

    def collect() -> Snapshot:
        st = persister.stats
        recent = st.batch_sizes
        # batch_sizes keeps recent sizes; fold in those not yet counted
        new = recent[-(st.batches - seen[0]) :] if st.batches > seen[0] else []
        for size in new:
            sizes.observe(size)
        seen[0] = st.batches
        counters = {name: dict(series) for name, series in counter.counts.items()}
        counters.update({
            "persister_batches_total": {"": st.batches},
            "persister_retries_total": {"": st.retries},
            "persister_claimed_total": {"": st.claimed},
            "persister_bad_entries_total": {"": st.bad_entries},
            "persister_parked_total": {"": st.parked},
        })  # fmt: skip
        return Snapshot(
            "",
            "",
            0.0,
            counters=counters,
            histograms={"persister_batch_size": {"": sizes.snapshot()}},
        )

    return collect


def reader_source(reader: StatusReader) -> Callable[[], Snapshot]:
    def collect() -> Snapshot:
        s = reader.stats()
        return Snapshot(
            "", "", 0.0,
            counters={
                "status_requests_total": {"": s["requests"]},
                "status_near_cache_hits_total": {"": s["near_hits"]},
                "status_redis_loads_total": {"": s["redis_loads"]},
                "status_redis_round_trips_total": {"": s["batches"]},
                "status_fallback_loads_total": {"": s["fallback_loads"]},
            },
            gauges={"status_listeners": {"": s["listeners"]}, "near_cache_entries": {"": s.get("near_size", 0)}},
        )  # fmt: skip

    return collect


async def live_gauges(queue: Queue, lag: Callable[[], Any] | None) -> dict[str, dict[str, float]]:
    """Gauges read from Redis now: depths, oldest waiting job per priority, dead letters,
    live workers, and (with Postgres) the write-behind lag."""
    from jobtier.model import PRIORITIES

    stats = (await queue.stats())["total"]
    out: dict[str, dict[str, float]] = {
        "queue_depth": {
            labels(priority=p.value): stats.get(f"queued_{p.value}", 0) for p in PRIORITIES
        },
        "scheduled_jobs": {"": stats.get("scheduled", 0)},
        "running_jobs": {"": stats.get("running", 0)},
        "dead_letter_jobs": {"": stats.get("dead", 0)},
    }
    keys, redis = queue.keys, queue.redis
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        for p in PRIORITIES:
            pipe.lindex(keys.queue(shard, p), -1)  # the oldest job of each queue
    oldest_ids = await pipe.execute()
    pipe = redis.pipeline(transaction=False)
    present = []
    for i, job_id in enumerate(oldest_ids):
        if job_id is not None:
            shard, index = divmod(i, len(PRIORITIES))
            pipe.hget(keys.job_in(shard, job_id.decode()), "updated")
            present.append(PRIORITIES[index].value)
    ages = {labels(priority=p.value): 0.0 for p in PRIORITIES}
    now = time.time() * 1000
    for priority, updated in zip(present, await pipe.execute() if present else [], strict=True):
        if updated is not None:
            key = labels(priority=priority)
            ages[key] = max(ages[key], (now - int(updated)) / 1000)
    out["oldest_queued_age_seconds"] = ages
    workers = 0
    for raw in (await redis.hgetall(keys.workers())).values():
        info = msgspec.json.decode(raw)
        if now / 1000 - float(info.get("seen_at", 0)) <= 60:
            workers += 1
    out["workers"] = {"": workers}
    if lag is not None:
        entries, seconds = await lag()
        out["persister_lag_transitions"] = {"": entries}
        out["persister_lag_seconds"] = {"": seconds}
    return out


if TYPE_CHECKING:  # only for annotations: importing them here would be circular
    from jobtier.cache.redis_reader import StatusReader
    from jobtier.persist.persister import Persister
    from jobtier.queue import Queue
    from jobtier.scheduler import Scheduler
    from jobtier.worker.runner import Worker
