"""The transition scripts' calls: a builder per script, its arguments in the order of the
script's header, and parsers of the replies. A ``Call`` names its script; ``Scripts`` runs it.

Builders take Python values and parsers return ``Code`` members and typed records, never
bare integers, so no caller knows a script's argument layout.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from jobtier.core.debounce import KeyedOption
from jobtier.core.errors import Code
from jobtier.core.model import DEFAULT_QUEUE, ClaimedJob

Call = tuple[str, int, Sequence[Any]]  # (script name, shard, arguments after the key base)

# a script's result code -> its Code member, by index (cheaper than Code(n) per job)
CODES = tuple(Code)


# not frozen: made once per job on the submit path, and a frozen dataclass's __init__ sets
# each field through object.__setattr__, which is slower
@dataclass(slots=True)
class SubmitOutcome:
    code: Code  # OK, DUPLICATE, IDEMPOTENCY_CONFLICT or EXISTS
    job_id: str
    doc: bytes  # the status document; empty for IDEMPOTENCY_CONFLICT (or an expired original)


@dataclass(slots=True)
class SubmitItem:
    job_id: str
    tenant: str
    type: str
    priority: str
    payload: bytes
    max_attempts: int
    run_at_ms: int  # 0: none
    delay_ms: int  # 0: none
    idempotency_key: str  # '': none
    request_hash: str
    queue: str = DEFAULT_QUEUE
    concurrency_key: str = ""  # '': none
    concurrency_limit: int = 1
    # dependencies, dependents, compensation: JSON for lib.lua's flow_create (b"": none)
    flow: bytes = b""
    # what the flow part was made from (not sent apart): "<type> <queue> <attempts>" of the
    # compensation task, and the existing jobs named by depends_on
    compensation: str = ""
    depends_on: tuple[str, ...] = ()
    # encrypts the payload (job id, plain JSON) as it is sent: a keyed flow's jobs get their
    # ids after they are prepared, and the ciphertext is bound to the id (core/sealing.py)
    seal: Callable[[str, bytes], bytes] | None = None
    # submitted alone by keyed.lua under a debounce or throttle key (store/keyed_calls.py)
    keyed: KeyedOption | None = None
    # no longer to start after this time (ms), or this long after the submit (ms); 0: none
    expires_at_ms: int = 0
    expires_in_ms: int = 0
    timeout_ms: int = 0  # the job's own bound on an attempt; 0: its task's

    def args(self) -> tuple[Any, ...]:
        payload = self.payload if self.seal is None else self.seal(self.job_id, self.payload)
        return (
            self.job_id,
            self.tenant,
            self.type,
            self.queue,
            self.priority,
            payload,
            self.max_attempts,
            self.run_at_ms,
            self.delay_ms,
            self.idempotency_key,
            self.request_hash,
            self.concurrency_key,
            self.concurrency_limit,
            self.flow,
            self.expires_at_ms,
            self.expires_in_ms,
            self.timeout_ms,
        )


@dataclass(frozen=True, slots=True)
class ClaimBatch:
    shard: int
    now_ms: int
    ready_left: int  # ready jobs still in the shard's served queues after this claim
    jobs: list[ClaimedJob]
    handed_back: list[str]  # ids of jobs of types the worker cannot run, left in their queue
    unaware: list[str]  # limited queues asked without a cap: take permits first (limit.lua)
    # when to look at the shard again (-1: no need): the first block of a served queue ends,
    # or now_ms: the claim stopped at its bound on expired jobs, ready ones behind them
    wake_at_ms: int = -1


@dataclass(frozen=True, slots=True)
class Timed:
    """Result of promote/reclaim: how many moved, and when the next one falls due."""

    moved: int
    dead: int
    next_ms: int  # -1: nothing waiting
    now_ms: int
    named: tuple[str, ...] = ()  # reclaim: the first expired jobs, '<id> <its worker>'


def _flat(head: list[Any], items: Sequence[Sequence[Any]]) -> list[Any]:
    for item in items:
        head.extend(item)
    return head


def submit_call(shard: int, items: Sequence[SubmitItem], idem_ttl_ms: int, trace: str = "") -> Call:
    """``trace``: the submit's W3C traceparent, which every job it creates keeps ('': none)."""
    args = _flat([idem_ttl_ms, trace, len(items)], [item.args() for item in items])
    return ("submit", shard, args)


def parse_submit(reply: list[Any]) -> list[SubmitOutcome]:
    return [
        SubmitOutcome(CODES[reply[i]], reply[i + 1].decode(), reply[i + 2] or b"")
        for i in range(0, len(reply), 3)
    ]


def claim_token() -> str:
    """A claim's token, unique per call: 96 random bits (a worker's processes fork, so no
    per-process counter would do)."""
    return secrets.token_urlsafe(12)


def may_have_run(error: BaseException) -> bool:
    """Whether a call that failed with ``error`` may have run, its reply lost with the
    connection: an error reply of Redis's (out of memory, CLUSTERDOWN, READONLY) says that
    send did not run. A claim that may have run is sent again with its token."""
    return not isinstance(error, ResponseError)


def claim_call(
    shard: int,
    worker: str,
    count: int,
    lease_ms: int,
    queues: Sequence[tuple[str, int]] = ((DEFAULT_QUEUE, -1),),
    types: Sequence[str] = (),
    token: str | None = None,
    retention_s: int = 86400,
) -> Call:
    """``queues``: (name, most jobs to take from it, -1 for no cap), in the order they share
    the call; ``types``: the task types the worker runs (empty: any, for tools);
    ``retention_s``: how long a job the claim finds expired stays in Redis, cancelled.

    ``token`` (a fresh one if None; '' for none) makes the call safe to send twice: the
    client library sends it again, the same bytes, when the connection dies before its reply,
    and claim.lua answers a token it already served with the jobs it leased then rather than
    leasing more (which would stay leased to a worker that never heard of them)."""
    args = _flat([worker, count, lease_ms, len(queues)], queues)
    args.append(len(types))
    args.extend(types)
    args.append(claim_token() if token is None else token)
    args.append(retention_s)
    return ("claim", shard, args)


def claim_replay(call: Call) -> Call:
    """``call`` (a ``claim_call``) asking for no job: claim.lua answers its token with the jobs
    it leased, if it ran, and otherwise leases none and writes nothing."""
    name, shard, args = call
    return (name, shard, [args[0], 0, *args[2:]])


def parse_claim(shard: int, reply: list[Any]) -> ClaimBatch:
    now, claimed, handed = int(reply[0]), int(reply[2]), int(reply[3])
    # 13 values per job; 9 from the scripts before the trace context, 10 before the
    # compensated job's id, 11 before the checkpoint, 12 before the job's own timeout (a
    # benchmark's baseline runs them: bench/transitions.py)
    width = (len(reply) - 6 - handed - int(reply[4])) // claimed if claimed else 11
    end = 6 + width * claimed
    jobs = [
        ClaimedJob(
            id=reply[i].decode(),
            type=reply[i + 1].decode(),
            payload=reply[i + 2],
            attempt=int(reply[i + 3]),
            max_attempts=int(reply[i + 4]),
            lease_version=int(reply[i + 5]),
            queued_at_ms=int(reply[i + 6]),
            claimed_at_ms=now,
            queue=reply[i + 7].decode(),
            inputs=(reply[i + 8][0], reply[i + 8][1]) if reply[i + 8] else None,
            trace=reply[i + 9].decode() if width > 9 and reply[i + 9] else None,
            compensates=reply[i + 10].decode() if width > 10 and reply[i + 10] else None,
            checkpoint=reply[i + 11] if width > 11 and reply[i + 11] else None,
            timeout=int(reply[i + 12]) / 1000 if width > 12 and reply[i + 12] else None,
        )
        for i in range(6, end, width)
    ]
    back = [r.decode() for r in reply[end : end + handed]]
    unaware = [r.decode() for r in reply[end + handed :]]
    return ClaimBatch(shard, now, int(reply[1]), jobs, back, unaware, int(reply[5]))


def heartbeat_call(
    shard: int,
    worker: str,
    lease_ms: int,
    items: Sequence[tuple[str, int, bytes]],
    history_ms: int = 0,
    checkpoints: Sequence[tuple[int, bytes]] = (),
) -> Call:
    """items: (job id, lease_version, progress JSON or b''). A progress change goes to the
    history only when the job's last logged entry is ``history_ms`` old (0: always).
    ``checkpoints``: (place of the job in ``items``, from 0; its state as JSON), saved under
    the same lease check (heartbeat.lua)."""
    args = _flat([worker, lease_ms, history_ms, len(items)], items)
    if checkpoints:
        args.append(len(checkpoints))
        args.extend(_flat([], [(i + 1, state) for i, state in checkpoints]))
    return ("heartbeat", shard, args)


def parse_pairs(reply: list[Any]) -> list[tuple[Code, Any]]:
    return [(CODES[reply[i]], reply[i + 1]) for i in range(0, len(reply), 2)]


def complete_call(
    shard: int, worker: str, retention_s: int, items: Sequence[tuple[str, int, bytes]]
) -> Call:
    """items: (job id, lease_version, result JSON or b'')."""
    return ("complete", shard, _flat([worker, retention_s, len(items)], items))


def fail_call(shard: int, worker: str, retention_s: int, items: Sequence[tuple[Any, ...]]) -> Call:
    """items: (job id, lease_version, error JSON, retry delay ms or -1 for no retry[, refund:
    1 when the attempt does not count])."""
    full = [item if len(item) == 5 else (*item, 0) for item in items]
    return ("fail", shard, _flat([worker, retention_s, len(items)], full))


def stopped_call(
    shard: int, worker: str, retention_s: int, items: Sequence[tuple[str, int]]
) -> Call:
    """items: (job id, lease_version): cancelled if a cancel was requested, else released."""
    return ("stopped", shard, _flat([worker, retention_s, len(items)], items))


def joblog_call(shard: int, keep: int, items: Sequence[tuple[str, int, Sequence[bytes]]]) -> Call:
    """items: (job id, ttl s, its new log lines); a job keeps its latest ``keep`` lines."""
    args: list[Any] = [keep, len(items)]
    for job_id, ttl, lines in items:
        args += (job_id, ttl, len(lines), *lines)
    return ("joblog", shard, args)


def cancel_call(shard: int, tenant: str, job_id: str, retention_s: int) -> Call:
    return ("cancel", shard, (tenant, job_id, retention_s))


def replay_call(shard: int, tenant: str, job_id: str) -> Call:
    return ("replay", shard, (tenant, job_id))


def promote_job_call(shard: int, tenant: str, job_id: str) -> Call:
    return ("promote_job", shard, (tenant, job_id))


def set_priority_call(shard: int, tenant: str, job_id: str, priority: str) -> Call:
    return ("set_priority", shard, (tenant, job_id, priority))


def parse_code_doc(reply: list[Any]) -> tuple[Code, bytes]:
    """A cancel's or a replay's reply: its code, and the job's status document."""
    return CODES[reply[0]], reply[1]


def purge_call(shard: int, queue: str, batch: int, budget: int, retention_s: int) -> Call:
    """Cancel up to ``batch`` of ``queue``'s ready jobs in ``shard`` (purge.lua); ``budget``
    -1 on a purge's first call."""
    return ("purge", shard, (queue, batch, budget, retention_s))


def parse_purge(reply: list[Any]) -> tuple[int, int, int, int]:
    """(cancelled by the call, taken out of the lists, budget left, ready and parked jobs of
    the queue left in the shard)."""
    return int(reply[0]), int(reply[1]), int(reply[2]), int(reply[3])


def promote_call(shard: int, limit: int) -> Call:
    return ("promote", shard, (limit,))


def parse_promote(reply: list[Any]) -> Timed:
    return Timed(int(reply[0]), 0, int(reply[1]), int(reply[2]))


def reclaim_call(shard: int, limit: int, retention_s: int, dead_s: int) -> Call:
    return ("reclaim", shard, (limit, retention_s, dead_s))


def parse_reclaim(reply: list[Any]) -> Timed:
    named = tuple(x.decode() for x in reply[4]) if len(reply) > 4 else ()
    return Timed(int(reply[0]), int(reply[1]), int(reply[2]), int(reply[3]), named)


def link_call(shard: int, tenant: str, links: Sequence[tuple[str, str]]) -> Call:
    """links: (dependency id of this shard, dependent id)."""
    return ("link", shard, _flat([tenant, len(links)], links))


def linked_call(shard: int, dependents: Sequence[str], head: str = "") -> Call:
    return ("linked", shard, [head, len(dependents), *dependents])


def resolve_call(
    shard: int, retention_s: int, items: Sequence[tuple[str, str, str, str, bytes]]
) -> Call:
    """items: (kind 'r' or 'x', target id of this shard, source id, state, data)."""
    return ("resolve", shard, _flat([retention_s, len(items)], items))
