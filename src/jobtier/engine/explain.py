"""Why a job has not started (``Explainer.explain``), from the Redis state the claim script
decides by.

The job's own shard is read by ``store/lua/explain.lua``, a read-only function of the same
library as ``claim.lua``: in one atomic step it reads the keys a claim reads (the queue's
paused, limited and blocked flags, its ready counts and priority cursor, the tenants' ring and
lists, the parked jobs, the concurrency key's count, line and limit) and applies the claim's
rules to them (the priorities' rotation, the tenants' turns). What lives elsewhere cannot be
in that step (a script touches one slot): a limited queue's permits are read by the same
function in the queue's home shard, as ``limit.lua`` counts them; the live workers from their
heartbeats (``QueueAdmin.live_workers``); the states of the jobs it waits for, which may be in
any shard, from their status documents.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from jobtier.core.errors import JobNotFound
from jobtier.core.explanation import Explanation, JobRef, Reason, ReasonCode
from jobtier.core.model import decode_status
from jobtier.core.names import HTTP_WORKER_PREFIX
from jobtier.engine.breaker_explain import breaker_reason
from jobtier.engine.queue_admin import QueueAdmin
from jobtier.status.docs import read_docs
from jobtier.store.context import Store

LISTED = 20  # dependencies and key holders named in an answer (the counts cover them all)
SCANNED = 1000  # tenants of its priority's ring the script reads
# jobs the script reads (an HMGET each) to find its concurrency key's holders
HOLDER_READS = 200
# entries the script's LPOS reads from each end of a line to find the job: a deeper job is
# answered as "more than LINE_BOUND ahead" (a whole scan holds Redis's one thread for as long)
LINE_BOUND = 10_000
_WAITING = ("queued", "scheduled", "waiting")


def iso(ms: int) -> str:
    """Epoch milliseconds as the status documents write times."""
    at = datetime.fromtimestamp(ms / 1000, UTC)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class OtherTenants(JobNotFound):
    """The job is another tenant's: answered as unknown, and no other store is asked."""


def _ids(refs: list[JobRef]) -> str:
    return ", ".join(f"{r.id} ({r.state or 'no longer kept'})" for r in refs)


class Explainer:
    """Explains jobs of one deployment (see the module docstring)."""

    def __init__(self, store: Store, admin: QueueAdmin) -> None:
        self.store = store
        self.admin = admin

    async def explain(self, job_id: str, tenant: str | None = None) -> Explanation:
        """Why ``job_id`` has not started; ``JobNotFound`` for an unknown id, a job Redis no
        longer holds, or (``tenant`` given) another tenant's."""
        keys, scripts = self.store.keys, self.store.scripts
        if not keys.valid_id(job_id):
            raise JobNotFound(job_id)
        if tenant is not None:
            # before the script: another tenant's id costs one read, and takes as long as an
            # unknown one
            owner = await self.store.redis.hget(keys.job(job_id), "tenant")
            if owner is None:
                raise JobNotFound(job_id)
            if owner != tenant.encode():
                raise OtherTenants(job_id)
        args = ("job", job_id, LISTED, SCANNED, HOLDER_READS, LINE_BOUND)
        facts: dict[str, Any] = msgspec.json.decode(
            await scripts.call("explain", keys.shard_of(job_id), args)
        )
        if "state" not in facts or (tenant is not None and facts["tenant"] != tenant):
            raise JobNotFound(job_id)
        now, state = int(facts["now"]), str(facts["state"])
        if state not in _WAITING:
            reason = Reason(ReasonCode.NOT_WAITING, _not_waiting(facts), queue=facts["queue"])
            return Explanation(job_id, state, False, [reason], None, iso(now))
        reasons, able = await self._queue_reasons(facts, now)
        held = await breaker_reason(self.store, job_id, str(facts["type"]), now)
        if held is not None:
            reasons.insert(0, held)
        where = facts.get("where")
        position = None
        if where == "scheduled":
            reasons.insert(0, _scheduled(facts, now))
        elif where == "waiting":
            reasons.insert(0, await self._dependencies(facts))
        elif where == "key":
            reasons.append(await self._key(facts))
        elif where in ("ready", "parked"):
            # deeper in its line than the script reads: a lower bound, so no position
            position = None if facts.get("at_least") else int(facts["ahead"]) + 1
            if facts.get("others"):
                reasons.append(_tenant_turn(facts))
            reasons.append(_in_line(facts, int(facts["ahead"]) + 1, able))
        else:
            message = "it is queued, yet in no line Redis keeps: the claim script cannot find it"
            reasons.append(Reason(ReasonCode.UNKNOWN, message, queue=facts["queue"]))
        if expired := _expired(facts, now):  # first: whatever else holds it, it will not run
            reasons.insert(0, expired)
        return Explanation(job_id, state, True, reasons, position, iso(now))

    # --- its queue ----------------------------------------------------------------------------
    async def _queue_reasons(
        self, facts: dict[str, Any], now: int
    ) -> tuple[list[Reason], list[dict[str, Any]]]:
        """What keeps every job of its queue from starting: paused, rate or concurrency
        limited, no worker for it; and the live workers that could run it."""
        queue, out = str(facts["queue"]), []
        if facts.get("paused"):
            message = f"queue {queue!r} is paused: nothing is claimed from it until it is resumed"
            out.append(Reason(ReasonCode.QUEUE_PAUSED, message, queue=queue))
        blocked = int(facts.get("blocked") or 0)
        if facts.get("limited"):
            out += await self._limits(queue, now, blocked)
        elif blocked > now:
            out.append(_blocked(queue, blocked, now))
        live = await self.admin.live_workers()
        serving = [w for w in live if queue in w.get("queues", ())]
        barred = []  # HTTP workers: only a Python worker takes a limited queue's permits
        if facts.get("limited"):
            barred = [w for w in serving if str(w.get("id", "")).startswith(HTTP_WORKER_PREFIX)]
            serving = [w for w in serving if w not in barred]
        able = [w for w in serving if facts["type"] in w.get("tasks", ())]
        if barred and not serving:
            n = len(barred)
            message = (
                f"no live worker that can take queue {queue!r}'s jobs serves it: "
                f"{plural(n, 'HTTP worker')} {'serves' if n == 1 else 'serve'} it, but the "
                "queue is limited (concurrency or rate), and only Python workers take its permits"
            )
            out.append(Reason(ReasonCode.NO_WORKER_FOR_QUEUE, message, queue=queue, workers=0))
        elif not serving:
            others = len(live)
            message = f"no live worker serves queue {queue!r}"
            if others:
                serve = "serves" if others == 1 else "serve"
                message += f" ({plural(others, 'live worker')} {serve} other queues)"
            out.append(Reason(ReasonCode.NO_WORKER_FOR_QUEUE, message, queue=queue, workers=0))
        elif not able:
            n = len(serving)
            message = (
                f"{plural(n, 'live worker')} {'serves' if n == 1 else 'serve'} queue {queue!r}, "
                f"but none runs task {facts['type']!r}"
            )
            reason = Reason(ReasonCode.NO_WORKER_FOR_TYPE, message, queue=queue)
            out.append(msgspec.structs.replace(reason, type=facts["type"], workers=0))
        return out, able

    async def _limits(self, queue: str, now: int, blocked: int) -> list[Reason]:
        """A limited queue's permits, read in its home shard as limit.lua grants them."""
        keys = self.store.keys
        raw = await self.store.scripts.call("explain", keys.home(queue), ("limit", queue))
        lim: dict[str, Any] = msgspec.json.decode(raw)
        now = int(lim["now"])
        out = []
        blocked = max(blocked, int(lim.get("blocked") or 0))
        if blocked > now:
            out.append(_blocked(queue, blocked, now))
        concurrency, held = lim.get("concurrency"), int(lim.get("held") or 0)
        if concurrency is not None and held >= int(concurrency):
            message = (
                f"queue {queue!r} is at its concurrency limit: {held} of {int(concurrency)} "
                "running, across every worker"
            )
            reason = Reason(ReasonCode.QUEUE_CONCURRENCY_FULL, message, queue=queue)
            out.append(msgspec.structs.replace(reason, running=held, limit=int(concurrency)))
        rate, period = lim.get("rate"), lim.get("period")
        started = int(lim.get("started") or 0)
        if rate is not None and period is not None and started >= int(rate):
            until = int(lim.get("next_start") or now)
            per = int(period) / 1000
            message = (
                f"queue {queue!r} is rate-limited until {iso(until)} (in "
                f"{(until - now) / 1000:.3f} s): {started} starts in the last {per:g} s, "
                f"its limit {int(rate)}"
            )
            reason = Reason(ReasonCode.RATE_LIMITED, message, queue=queue, until=iso(until))
            out.append(
                msgspec.structs.replace(
                    reason, seconds=(until - now) / 1000, rate=int(rate), per=per, started=started
                )
            )
        return out

    # --- where it waits -----------------------------------------------------------------------
    async def _states(self, ids: list[str]) -> list[JobRef]:
        """Each job's state now, from its status document (any shard)."""
        found = await read_docs(self.store.redis, self.store.keys, ids) if ids else []
        states = [None if doc is None else str(decode_status(doc).state) for _, doc in found]
        return [JobRef(i, s) for i, s in zip(ids, states, strict=True)]

    async def _dependencies(self, facts: dict[str, Any]) -> Reason:
        total, pending, failed = (int(facts.get(k) or 0) for k in ("total", "pending", "failed"))
        deps = await self._states(list(facts.get("pending_ids") or []))
        message = f"it waits for {pending} of its {plural(total, 'dependency')}"
        if deps:
            more = pending - len(deps)
            message += ": " + _ids(deps) + (f" and {more} more" if more > 0 else "")
        if failed:
            message += f" ({failed} did not succeed)"
        reason = Reason(ReasonCode.WAITING_FOR_DEPENDENCIES, message, dependencies=deps)
        return msgspec.structs.replace(reason, pending=pending, total=total, failed=failed)

    async def _key(self, facts: dict[str, Any]) -> Reason:
        key, admitted, limit = str(facts["key"]), int(facts["admitted"]), int(facts["limit"])
        ahead = int(facts.get("ahead") or 0)
        found = [JobRef(str(i), str(s)) for i, s in facts.get("holders") or []]
        holders = await self._states([h.id for h in found])
        message = (
            f"its concurrency key {key!r} is held: {admitted} of {limit} places taken "
            "(jobs running or ready under it)"
        )
        if holders:
            message += f", by {_ids(holders)}"
        at_least = bool(facts.get("at_least"))
        if at_least:
            message += f"; at least {ahead} jobs of the key wait before it"
        elif ahead:
            waits = "waits" if ahead == 1 else "wait"
            message += f"; {plural(ahead, 'job')} of the key {waits} before it"
        reason = Reason(ReasonCode.CONCURRENCY_KEY_HELD, message, key=key, holders=holders)
        reason = msgspec.structs.replace(reason, running=admitted, limit=limit, ahead=ahead)
        return msgspec.structs.replace(reason, at_least=True) if at_least else reason


def _not_waiting(facts: dict[str, Any]) -> str:
    state = facts["state"]
    if state == "running":
        worker = facts.get("worker") or "?"
        return f"it is not waiting: it is running (attempt {facts.get('attempt')}, worker {worker})"
    return f"it is not waiting: it has finished ({state})"


def _blocked(queue: str, until: int, now: int) -> Reason:
    message = (
        f"queue {queue!r} is rate-limited until {iso(until)} (in {(until - now) / 1000:.3f} s): "
        "a task raised RateLimited, or an HTTP worker held a job with block_queue (jobtier "
        "queues unblock lifts it)"
    )
    reason = Reason(ReasonCode.RATE_LIMITED, message, queue=queue, until=iso(until))
    return msgspec.structs.replace(reason, seconds=(until - now) / 1000)


def _expired(facts: dict[str, Any], now: int) -> Reason | None:
    """Past its expiry, or due (its run_at) after it: the claim that reaches it cancels it
    (claim.lua, docs/expiry.md). None for a job with no expiry, or due before it."""
    expires, run_at = int(facts.get("expires") or 0), int(facts.get("run_at") or 0)
    if not expires or (expires > now and run_at < expires):
        return None
    if expires <= now:
        message = (
            f"it is past its expiry ({iso(expires)}): the first claim to reach it cancels it "
            "(Expired) rather than run it"
        )
    else:
        message = (
            f"it is due at {iso(run_at)}, at or after its expiry ({iso(expires)}): it will be "
            "cancelled (Expired) then, not run"
        )
    reason = Reason(ReasonCode.EXPIRED, message, until=iso(expires))
    return msgspec.structs.replace(reason, seconds=(expires - now) / 1000)


def _scheduled(facts: dict[str, Any], now: int) -> Reason:
    run_at = int(facts["run_at"])
    seconds = (run_at - now) / 1000
    attempt = int(facts.get("attempt") or 0)
    if seconds > 0 and attempt:  # a failed attempt's retry waits for its backoff
        message = f"its attempt {attempt + 1} is scheduled for {iso(run_at)} (in {seconds:.3f} s)"
    elif seconds > 0:
        message = f"it is scheduled for {iso(run_at)} (in {seconds:.3f} s)"
    else:
        message = (
            f"it was due at {iso(run_at)} ({-seconds:.3f} s ago): the scheduler moves it to its "
            "queue (is a scheduler running?)"
        )
    return Reason(ReasonCode.SCHEDULED, message, until=iso(run_at), seconds=seconds)


def _tenant_turn(facts: dict[str, Any]) -> Reason:
    others, tenants, own = int(facts["others"]), int(facts["tenants"]), int(facts["own"])
    at_least = bool(facts.get("at_least"))
    message = (
        f"tenants take turns at its priority ({plural(tenants, 'tenant')} with ready jobs): "
        f"{'at least ' if at_least else ''}{plural(others, 'job')} of other tenants come "
        "before it"
    )
    if at_least:
        message += f", and at least {own} older of its own tenant"
    elif own:
        message += f", and {own} older of its own tenant"
    reason = Reason(ReasonCode.TENANT_TURN, message, queue=facts["queue"], ahead=others)
    return msgspec.structs.replace(reason, tenants=tenants, at_least=at_least or None)


def _in_line(facts: dict[str, Any], position: int, able: list[dict[str, Any]]) -> Reason:
    queue, ahead = str(facts["queue"]), position - 1
    slots = sum(int(w.get("concurrency", 0)) for w in able)
    in_use = sum(min(int(w.get("running", 0)), int(w.get("concurrency", 0))) for w in able)
    busy = sum(int(w.get("running", 0)) >= int(w.get("concurrency", 0)) for w in able)
    where = "its queue's handed-back jobs" if facts["where"] == "parked" else "its queue"
    at_least = bool(facts.get("at_least"))
    if at_least:
        message = (
            f"it is in line in {where} on its shard with at least {ahead} ahead (deeper than "
            f"the {LINE_BOUND} jobs read from either end of its line)"
        )
    elif ahead:
        message = f"it is {ordinal(position)} in line in {where} on its shard ({ahead} ahead)"
    else:
        message = f"it is first in line in {where} on its shard"
    if able and busy == len(able):
        whose = "its worker is" if len(able) == 1 else f"its {len(able)} workers are"
        message += f"; {whose} busy: {in_use} of {slots} slots in use"
    elif able:
        free = len(able) - busy
        verb = "has" if free == 1 else "have"
        message += f"; {plural(free, 'worker')} that can run it {verb} a free slot"
    reason = Reason(ReasonCode.IN_LINE, message, queue=queue, ahead=ahead)
    return msgspec.structs.replace(
        reason,
        workers=len(able),
        busy=busy,
        slots=slots,
        in_use=in_use,
        at_least=at_least or None,
    )
