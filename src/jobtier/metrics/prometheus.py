"""``/metrics``: every live process's snapshot and the live gauges, as Prometheus text."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from jobtier.metrics.snapshot import Snapshot, live_processes, parse_labels

HELP = {
    "jobs_submitted_total": "Jobs created (submit, batch submit, schedule firings).",
    "jobs_claimed_total": "Attempts started: queued -> running.",
    "jobs_succeeded_total": "Jobs that succeeded.",
    "jobs_failed_total": "Attempts that failed (retried, dead-lettered, or ending their job by its expiry).",
    "jobs_retried_total": "Failed attempts scheduled to run again.",
    "jobs_held_total": "Attempts given back, not failed: the task raised RateLimited, an open circuit breaker held the job, or an HTTP worker said held.",
    "jobs_dead_lettered_total": "Jobs that went to the dead-letter set.",
    "jobs_cancelled_total": "Jobs cancelled.",
    "jobs_expired_total": "Jobs cancelled by their expiry: a claim met them past it, or their retry was due after it (in jobs_cancelled_total too).",
    "lease_expirations_total": "Running jobs taken back after their worker stopped heartbeating.",
    "transitions_persisted_total": "Transitions written to Postgres.",
    "submits_refused_total": "Jobs whose submit was refused (429/503), by priority and reason (shed: load shedding).",
    "persister_bad_entries_total": "Log entries that could not be stored (unreadable or refused).",
    "persister_parked_total": "Log entries Postgres refused, moved to the shard's log:refused stream.",
    "dispatcher_entries_total": "Transitions a webhook dispatcher read from the log and handled.",
    "dispatcher_entries_skipped_total": "Transitions of tenants with no webhook: no delivery looked for.",
    "dispatcher_target_lookups_total": "Batches whose webhook targets were looked up in Postgres.",
    "dispatcher_tenants_unmarked_total": "Tenants unmarked by the dispatcher: no webhook target left.",
    "dispatcher_claimed_total": "Log entries taken over from a dispatcher that stopped.",
    "dispatcher_bad_entries_total": "Log entries a dispatcher could not read (acknowledged, logged).",
    "webhook_attempts_total": "Webhook delivery attempts by outcome (delivered, retried, refused, failed, gone).",
    "webhook_deliveries_created_total": "Webhook deliveries made from transitions (one per target).",
    "webhook_deliveries_pending": "Webhook deliveries waiting in Postgres for an attempt (a dispatcher's view).",
    "webhook_delivery_latency_seconds": "From a transition to its webhook's 2xx answer.",
    "webhook_attempt_seconds": "Duration of one webhook delivery attempt.",
    "queue_depth": "Ready jobs per queue and priority.",
    "queue_running_jobs": "Jobs of the queue running now.",
    "queue_parked_jobs": "Jobs handed back by workers that lack their task, waiting for one that has it.",
    "queue_held_jobs": "Queued jobs held behind their concurrency keys, each waiting for its key's turn (not in the queue's depth).",
    "queue_paused": "1 while the queue is paused.",
    "queue_blocked_seconds": "Seconds left of the queue's block (a task raised RateLimited, or an HTTP worker's held attempt asked block_queue): no job of it starts meanwhile; 0 when not blocked.",
    "breaker_state": "A circuit breaker's state: 0 closed, 1 open, 2 half-open (its open period is over: its next job is a probe).",
    "processes": "Live jobtier processes by role (those whose metrics snapshot is fresh); 0 for a role with none.",
    "redis_memory_used_bytes": "used_memory of the fullest Redis primary.",
    "redis_memory_max_bytes": "maxmemory of that primary (0: no limit).",
    "redis_memory_used_ratio": "used_memory / maxmemory of the fullest primary (0 without a limit); submits are refused past JOBTIER_REDIS_MEMORY_REFUSE_RATIO.",
    "persister_lag_transitions": "Transitions not yet in Postgres (exported when the API has Postgres).",
    "persister_lag_seconds": "Age of the oldest transition not yet in Postgres.",
    "outbox_pending_rows": "Jobs submitted with SQL (jobtier.submit) whose rows the outbox relay has not taken yet, counted up to 100,000 (exported when the API has Postgres; read every 5 s at most).",
    "outbox_oldest_pending_seconds": "Age of the oldest outbox row not yet relayed that the relay should take now (0 with none; rows waiting for a worker of their type are not counted).",
    "dispatcher_lag_transitions": "Transitions the webhook dispatchers have not yet handled (exported once any webhook or job callback was accepted); the logs keep them in Redis meanwhile.",
    "dispatcher_lag_seconds": "Age of the oldest transition the webhook dispatchers have not yet handled.",
    "oldest_queued_age_seconds": "How long the oldest ready job of the queue and priority has waited.",
    "worker_handed_back_total": "Jobs this worker handed back (their task is not in it).",
    "worker_rate_limited_total": "Tasks that raised RateLimited.",
    "worker_checkpoints_total": "Checkpoint states saved by tasks (ctx.checkpoint).",
    "worker_loop_blocked_total": "Times a worker's event loop went unanswered past its --blocked-warn seconds (a blocking call in an async def task).",
    "worker_processes_total": "Process pool children by event: started, recycled, ended (cancel, timeout, release), died (a crash).",
    "worker_breaker_holds_total": "Jobs a worker did not start because their circuit breaker was open (no call, no attempt).",
    "queue_limit_wait_seconds_total": "Seconds a worker waited for a limited queue's permits (rate or concurrency).",
    "waiting_jobs": "Jobs waiting for their dependencies (flows).",
    "queue_waiting_jobs": "Jobs of the queue waiting for their dependencies.",
    "resolver_handoffs_total": "Flow hand-offs (a job finished with dependents, a parent cancelled) applied and acknowledged.",
    "resolver_applied_total": "Dependents told: a dependency resolved, or a child cancelled with its parent.",
    "resolver_repeated_total": "Hand-offs applied again after their resolver died (no-ops: each dependency resolves once).",
    "resolver_moot_total": "Hand-offs whose dependent no longer waited for them (resolved, cancelled or gone).",
    "resolver_claimed_total": "Hand-offs taken over from a resolver that stopped before acknowledging them.",
    "resolver_relinked_total": "Dependents linked by a resolver because their submit was cut short.",
    "persister_errors_total": "Failures the persister retried (Postgres, Redis, its own tasks), by error class.",
    "reconciled_total": "Jobs a persister's reconcile pass put back into Redis from Postgres after a failover, by kind (restored, advanced, requeued).",
    "persister_batch_size": "Transitions per batch the persister committed.",
    "persister_batch_wait_seconds": "Age of a committed batch's oldest transition when its write began (in the log, then in the persister until one of its concurrent writes was free; an entry taken over from a stopped persister counts from when it was made).",
    "persister_batch_write_seconds": "Time to write a batch to Postgres, commit and retries included.",
    "persister_batches_total": "Batches of transitions the persister committed to Postgres.",
    "persister_retries_total": "Batch writes the persister tried again after a failure.",
    "persister_claimed_total": "Log entries a persister took over from one that stopped before writing them.",
    "persister_rows_collapsed_total": "Held job rows a newer version replaced before they were written (JOBTIER_PERSIST_HOLD_SECONDS).",
    "outbox_relayed_total": "Outbox rows (jobs submitted with SQL) the relay made jobs of.",
    "outbox_refused_total": "Outbox rows the relay refused (each marked with its reason).",
    "outbox_duplicates_total": "Outbox rows whose job was there already (relayed again after a pass died before its commit).",
    "outbox_deferred_total": "Outbox rows left for a later pass: a job they depend on is not relayed yet, or no worker has advertised their type yet.",
    "outbox_batches_total": "Passes of the outbox relay that took rows.",
    "outbox_paused_total": "Passes the outbox relay skipped, by reason (waiting: too many jobs wait; memory: Redis is too full).",
    "outbox_errors_total": "Outbox relay passes that failed (their rows wait for the next), by error class.",
    "scheduler_passes_total": "Passes a scheduler made over the shards (promotions, expired leases, cron).",
    "scheduler_promoted_total": "Scheduled jobs a scheduler made ready as their run time came (delays, retries' back-off).",
    "scheduler_requeued_total": "Running jobs whose lease expired that a scheduler put back in their queue (their worker stopped heartbeating).",
    "scheduler_dead_lettered_total": "Running jobs whose lease expired on their last attempt, which a scheduler dead-lettered.",
    "schedule_firings_total": "Jobs made by recurring schedules (cron or interval) as their slots came.",
    "webhook_attempts_in_flight": "Webhook delivery attempts a dispatcher has under way now (at most JOBTIER_WEBHOOK_CONCURRENCY).",
    "scheduled_jobs": "Jobs waiting for their run time (delayed, or a retry's back-off).",
    "running_jobs": "Jobs running now, on every queue.",
    "dead_letter_jobs": "Jobs in the dead-letter set.",
    "workers": "Live workers: those that advertised themselves lately (Python and HTTP workers).",
    "worker_jobs_started_total": "Jobs this worker claimed and started.",
    "worker_claim_round_trips_total": "Claim calls this worker made to Redis.",
    "worker_outcomes_total": "Attempts this worker ended, by outcome (succeeded, retried, failed, cancelled, released).",
    "stale_writes_refused_total": "Outcomes this worker sent that Redis refused: the job had moved on (its lease lost).",
    "leases_lost_total": "Running jobs whose lease this worker found lost (taken back, cancelled or gone).",
    "worker_running_jobs": "Jobs this worker is running now.",
    "worker_concurrency": "Jobs this worker may run at once.",
    "claim_wait_seconds": "From a job's being ready to its claim by this worker (queue wait).",
    "run_time_seconds": "How long this worker's tasks ran, per attempt.",
    "status_requests_total": "Status reads this API served.",
    "status_near_cache_hits_total": "Status reads answered from the API's near cache.",
    "status_redis_loads_total": "Job documents the API read from Redis for status reads.",
    "status_redis_round_trips_total": "Round trips to Redis for status reads (coalesced reads share one).",
    "status_fallback_loads_total": "Job ids the API asked Postgres for, Redis no longer keeping them.",
    "status_listeners": "Long polls and event streams waiting for a job's next version in this API now.",
    "near_cache_entries": "Job documents in this API's near cache.",
}


FAMILIES = {
    "counters": CounterMetricFamily,  # which strips a name's _total
    "gauges": GaugeMetricFamily,
    "histograms": HistogramMetricFamily,
}


class SnapshotCollector(Collector):
    """prometheus_client collector over the process snapshots and the live gauges."""

    def __init__(self, snapshots: list[Snapshot], gauges: dict[str, dict[str, float]]) -> None:
        self.snapshots = snapshots
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        kinds: dict[str, dict[str, list[tuple[dict[str, str], Any]]]] = {
            kind: defaultdict(list) for kind in FAMILIES
        }
        for snap in self.snapshots:
            own = {"process": snap.process, "role": snap.role}
            for kind, samples in kinds.items():
                for name, series in getattr(snap, kind).items():
                    samples[name] += [({**own, **parse_labels(k)}, v) for k, v in series.items()]
        gauges = {**self.gauges, "processes": live_processes(self.snapshots)}
        for name, series in gauges.items():
            kinds["gauges"][name] += [(parse_labels(k), v) for k, v in series.items()]
        for kind, samples in kinds.items():
            for name, rows in sorted(samples.items()):
                names = _label_names(rows)
                family = FAMILIES[kind](f"jobtier_{name}", HELP.get(name, name), labels=names)
                for lv, value in rows:
                    values = [lv.get(n, "") for n in names]
                    if kind == "histograms":
                        family.add_metric(values, _buckets(value), value["sum"])
                    else:
                        family.add_metric(values, value)
                yield family


def _buckets(hist: dict[str, Any]) -> list[tuple[str, float]]:
    cumulative, buckets = 0, []
    for bound, n in zip([*hist["bounds"], float("inf")], hist["counts"], strict=True):
        cumulative += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    return buckets


def _label_names(samples: Sequence[tuple[dict[str, str], Any]]) -> list[str]:
    return sorted({name for lv, _ in samples for name in lv})


def render(snapshots: list[Snapshot], gauges: dict[str, dict[str, float]]) -> bytes:
    from prometheus_client import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshots, gauges))
    return generate_latest(registry)
