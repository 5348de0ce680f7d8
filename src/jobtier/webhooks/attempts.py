"""The dispatcher's second half: deliveries in Postgres -> signed HTTP POSTs. Due deliveries
are leased (shared by every dispatcher), attempted ``webhook_concurrency`` at once, and their
outcomes recorded in batches; a failed one waits in Postgres for its next attempt."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from jobtier.config import Settings
from jobtier.metrics.histogram import Histogram
from jobtier.runtime.backoff import PERSIST_POSTGRES
from jobtier.runtime.loop import wait_for
from jobtier.webhooks import signing
from jobtier.webhooks.deliveries import PG_UNAVAILABLE, Attempt, DeliveryStore, Outcome
from jobtier.webhooks.sender import Answer, Sender

log = logging.getLogger("jobtier.webhooks")

DUE_POLL = 1.0  # longest wait before looking for due retries again
RECORD_EVERY = 0.05  # outcomes are recorded in batches, at most this long after the attempt
SECRETS_TTL = 5.0  # a rotation reaches deliveries within this (the old secret still signs)
GAUGE_EVERY = 5.0
LEASE_MARGIN = 10.0  # a lease outlives the attempt's time limit by this much
JITTER = 0.1


@dataclass
class AttemptStats:
    """What the attempts came to since the dispatcher started (its webhook metrics)."""

    attempts: dict[str, int] = field(default_factory=dict)  # by outcome
    pending: int = 0  # deliveries waiting in Postgres (refreshed every few seconds)
    latency: Histogram = field(default_factory=Histogram, repr=False)  # transition -> 2xx
    attempt_time: Histogram = field(default_factory=Histogram, repr=False)


class Attempts:
    """Leases due deliveries and attempts them until ``stopping`` is set (``send``), and
    records their outcomes (``record``, until the attempts in flight have ended)."""

    def __init__(
        self, settings: Settings, store: DeliveryStore, sender: Sender, stopping: asyncio.Event
    ) -> None:
        self.store = store
        self.sender = sender
        self.stopping = stopping
        self.schedule = settings.webhook_retry_delays()
        self.concurrency = settings.webhook_concurrency
        self.lease_seconds = settings.webhook_timeout_seconds + LEASE_MARGIN
        self.stats = AttemptStats()
        self.running: set[asyncio.Task[None]] = set()
        self._refill = max(1, self.concurrency // 4)
        self._more_due = False
        self._due = asyncio.Event()  # new deliveries were inserted: lease them now
        self._outcomes: list[Outcome] = []
        # delivery -> its subscription, disabled once the 410 that asked for it is recorded
        self._gone: dict[str, str] = {}
        self._recorded = asyncio.Event()
        self._secrets: dict[str, tuple[float, list[str]]] = {}

    def due(self) -> None:
        """Deliveries were inserted (or we are stopping): look now."""
        self._due.set()

    async def send(self) -> None:
        backoff = PERSIST_POSTGRES.start()
        next_gauge = 0.0
        while not self.stopping.is_set():
            self._due.clear()
            try:
                if time.monotonic() >= next_gauge:
                    next_gauge = time.monotonic() + GAUGE_EVERY
                    self.stats.pending, _ = await self.store.pending()
                free = self.concurrency - len(self.running)
                asked = min(free, 500)
                leased = await self.store.lease_due(asked, self.lease_seconds)
                # a full lease may have left due ones behind: freed slots ask again
                self._more_due = asked > 0 and len(leased) == asked
                backoff.reset()
            except PG_UNAVAILABLE as exc:
                wait = backoff.next()
                log.warning("event=postgres_unavailable retry_in=%.1fs error=%r", wait, exc)
                await wait_for(self.stopping, wait)
                continue
            for attempt in leased:
                task = asyncio.create_task(self._attempt(attempt), name=f"webhook {attempt.id}")
                self.running.add(task)
                task.add_done_callback(self._attempt_done)
            if leased and len(leased) == free:
                continue  # more may be due: look again as soon as a slot frees
            if not leased or len(self.running) < self.concurrency:
                await wait_for(self._due, DUE_POLL)

    def _attempt_done(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        if self._more_due and self.concurrency - len(self.running) >= self._refill:
            # lease again once a quarter of the slots are free, not per slot (one query
            # per freed slot would cost more than the attempts) and not at the next poll
            self._due.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("event=attempt_crashed error=%r", task.exception())

    async def _secrets_for(self, tenant: str) -> list[str]:
        now = time.monotonic()
        cached = self._secrets.get(tenant)
        if cached is None or cached[0] < now:
            found = await self.store.secrets([tenant])
            cached = (now + SECRETS_TTL, found.get(tenant, []))
            self._secrets[tenant] = cached
        return cached[1]

    async def _attempt(self, a: Attempt) -> None:
        """One attempt: sign, POST, and queue its outcome for recording."""
        try:
            secrets = await self._secrets_for(a.tenant)
        except PG_UNAVAILABLE as exc:
            log.warning("event=secrets_unavailable delivery=%s error=%r", a.id, exc)
            return  # the lease runs out and the delivery comes due again
        if secrets:
            headers = signing.headers(secrets, a.id, int(time.time()), a.body)
            answer = await self.sender.post(a.url, headers, a.body)
        else:
            answer = Answer(None, 0.0, "the tenant has no signing secret")
        self.stats.attempt_time.observe(answer.duration_ms / 1000)
        self._outcome(a, answer)

    def _outcome(self, a: Attempt, answer: Answer) -> None:
        now = datetime.now(UTC)
        made = a.attempts + 1
        status = answer.status
        next_at: datetime | None = None
        if status is not None and 200 <= status < 300:
            state, kind = "delivered", "delivered"
            self.stats.latency.observe(max(0.0, (now - a.occurred_at).total_seconds()))
        elif status == 410:
            # the receiver wants no more (Standard Webhooks): its subscription is disabled,
            # once this attempt is recorded (disabling cancels the subscription's pending
            # deliveries, which until then include this one: its attempt would go unrecorded)
            state, kind = "failed", "gone"
            if a.subscription_id is not None:
                self._gone[a.id] = a.subscription_id
        elif made > len(self.schedule):
            state, kind = "failed", "failed"
        else:
            delay = self.schedule[made - 1] * random.uniform(1 - JITTER, 1 + JITTER)
            if answer.retry_after is not None:
                delay = min(max(delay, answer.retry_after), max(self.schedule))
            state, kind = "pending", "refused" if answer.refused else "retried"
            next_at = now + timedelta(seconds=delay)
        self.stats.attempts[kind] = self.stats.attempts.get(kind, 0) + 1
        log.log(
            logging.DEBUG if state == "delivered" else logging.INFO,
            "event=webhook_attempt delivery=%s job=%s attempt=%d status=%s outcome=%s error=%s",
            a.id,
            a.job_id,
            made,
            status,
            kind,
            answer.error,
        )
        self._outcomes.append(
            Outcome(
                a.id,
                a.lease,
                state,
                now,
                answer.duration_ms,
                status,
                answer.error,
                answer.body,
                next_at,
            )
        )
        if len(self._outcomes) >= 200:
            self._recorded.set()

    async def _disable(self, subscription_id: str) -> None:
        """Disable a subscription whose receiver answered 410 (its attempt recorded): Postgres
        away, the next 410 does it; anything else is logged, never the recording's end."""
        try:
            await self.store.disable_subscription(subscription_id)
        except PG_UNAVAILABLE:
            return
        except Exception:
            log.exception("event=subscription_disable_failed id=%s", subscription_id)
            return
        log.info("event=subscription_disabled id=%s reason=410", subscription_id)

    async def finish(self) -> None:
        """Stopping: the attempts in flight get their time limit to end; then record."""
        if self.running:
            await asyncio.wait(self.running, timeout=self.sender.timeout + 1)
        self._recorded.set()

    async def record(self) -> None:
        """Record outcomes in batches. An outcome Postgres will not take stays queued; if the
        dispatcher dies first, the delivery's lease runs out and it is attempted again."""
        backoff = PERSIST_POSTGRES.start()
        while True:
            await wait_for(self._recorded, RECORD_EVERY)
            self._recorded.clear()
            stopping = self.stopping.is_set() and not self.running
            todo, self._outcomes = self._outcomes, []
            if todo:
                try:
                    await self.store.record(todo)
                    backoff.reset()
                    for gone in [self._gone.pop(o.id) for o in todo if o.id in self._gone]:
                        await self._disable(gone)
                    self._due.set()  # a retry due at once (a schedule of 0 s) goes now
                except PG_UNAVAILABLE as exc:
                    self._outcomes[:0] = todo
                    if stopping:
                        return
                    wait = backoff.next()
                    log.warning("event=record_failed retry_in=%.1fs error=%r", wait, exc)
                    await asyncio.sleep(wait)
                    continue
            if stopping and not self._outcomes:
                return
