"""Every Redis key and channel name, job ids, and shard routing.

A deployment has a fixed number of logical shards. Every key of shard ``s`` starts with
``{prefix}:{s}:`` around a hash tag (``jt:{7}:q:high``), so one Lua script only ever touches
one shard and Redis Cluster places whole shards on nodes by itself.

Per shard::

    jt:{s}:job:<id>          hash   the job record: its small fields packed, no status
                                    document (see "Job hashes")
    jt:{s}:fmt               string "3": the shard's scripts write job hashes in that format
                                    (store/format.py: processes refuse any other mark)
    jt:{s}:fmt:done          string "1": it holds no hash in an older format (set with the
                                    mark on a new shard, or by `jobtier job-format --upgrade`)
    jt:{s}:lines:<id>        list   the job's latest log lines (ctx.log; JSON each), expiring
                                    with the job (joblog.lua)
    jt:{s}:q:<queue>:<priority>:<tenant>
                             list   ready jobs (LPUSH new, RPOP oldest: FIFO)
    jt:{s}:ring:<queue>:<priority>
                             list   the tenants with ready jobs there, in claim rotation
    jt:{s}:queues            hash   per queue q: "q:<priority>" ready jobs, "q:running",
                                    "q:held" (behind concurrency keys), "q:paused" ("1"),
                                    "q:wrr" (the priority rotation cursor)
    jt:{s}:park:<queue>:<type> list jobs handed back by a worker that cannot run them
    jt:{s}:parked            hash   "<queue>:<type>" -> jobs parked there
    jt:{s}:limit:<queue>     hash   a limited queue's limits and rate bucket (home shard)
    jt:{s}:permits:<queue>   zset   the permits held for it, by lease deadline (home shard)
    jt:{s}:starts:<queue>    zset   its permits granted in the last rate period (home shard)
    jt:{s}:pt:<token>        string the permits an acquire with that token granted (msgpack),
                                    kept for their lease: sent again, it answers them
                                    (limit.lua; home shard)
    jt:{s}:breaker:<name>    hash   a circuit breaker's state (home shard of the name:
                                    breaker.lua, docs/breakers.md)
    jt:{s}:bfail:<name>      zset   its failures in the window (home shard)
    jt:{s}:bok:<name>        zset   its successes in the window, with a ratio (home shard)
    jt:{s}:bprobe:<name>     zset   its half-open probes out, by lease deadline (home shard)
    jt:{s}:breakers          set    the breakers homed in this shard (the admin list)
    jt:{s}:ck:<tenant>:<key> list   jobs held behind their concurrency key (oldest first)
    jt:{s}:ckeys             hash   "<tenant>:<key>" -> its jobs ready or running, and
                                    "<tenant>:<key>:limit"
    jt:{s}:sched             zset   scheduled jobs by run-at (ms)
    jt:{s}:active            zset   running jobs by lease deadline (ms)
    jt:{s}:ct:<token>        string what a claim with that token leased (msgpack), kept for
                                    its lease: the call sent again answers it again (claim.lua)
    jt:{s}:dead              zset   failed jobs (the dead-letter set) by failure time (ms)
    jt:{s}:idem:<tenant>:<k> string idempotency record: "<job id> <request hash>"
    jt:{s}:db:<tenant>:<queue>:<type> <key>
                             hash   a debounce key: its pending job ('id') and when its
                                    first submit came ('first', ms): keyed.lua
    jt:{s}:th:<tenant>:<key> zset   a throttle key's slots: job id -> when it may start (ms)
    jt:{s}:uq:<tenant>:<key> string a unique key's latest job (keyed.lua); that job's end
                                    deletes it (lib.lua finish)
    jt:{s}:waiting           hash   tenant -> waiting+queued+scheduled jobs in this shard
    jt:{s}:deps:<id>         hash   a job's dependencies: id -> '0'/'1' (pending; '1': a
                                    child) or a state mark and the result/error (lib.lua)
    jt:{s}:dnt:<id>          set    a job's dependents (ids, any shard)
    jt:{s}:unlinked          zset   dependents whose submitter has not yet linked every
                                    dependency, by when the resolver links them itself (ms)
    jt:{s}:flow              stream hand-offs of finished jobs to their dependents (and of
                                    cancelled parents to their children), for the resolver
    jt:{s}:batch:<id>        hash   a batch's record, in the batch id's shard: tenant, total,
                                    its children's shards, how many have not finished, each
                                    shard's last hand-off, the callback (flows/batches.py)
    jt:{s}:bt:<id prefix>    hash   a batch's counts in this shard ("bid" its id, "n", "left",
                                    "s"/"f"/"c" by final state, "e" its last hand-off's
                                    epoch), named by the 18 characters its children's ids
                                    share with the batch's (flows/batches.py)
    jt:{s}:wrr               string before named queues: the priority rotation
                                    (``jobtier job-format --upgrade`` moves the old ready
                                    lists, jt:{s}:q:<priority>, then deletes it)
    jt:{s}:cron              zset   recurring schedules of this shard by next fire time (ms)
    jt:{s}:cron:<id>         hash   a schedule: "def" (JSON), "next", "last" (ms), "paused"
    jt:{s}:log               stream every transition, read by the persister (write-behind):
                                    an entry per script call, its transitions in it
                                    (streams/entries.py)
    jt:{s}:log:refused       stream log entries Postgres refused for their data, parked
    jt:{s}:ev                shard channel: "<id> <version> <tenant>\\n<status document>"
    jt:{s}:wake              shard channel: "q <queue>" (a queue had no ready job and
                             now has some, or parked ones), "l <queue>" (permits of a
                             limited queue came free), "s <ms>" (an
                             earlier run-at to wake the scheduler for), "c <ms>" (a
                             schedule's next firing), "x <job id> <worker id>" (a
                             cancel was requested for a job that worker runs) or "f"
                             (hand-offs in jt:{s}:flow)

Before named queues, ready jobs waited in ``jt:{s}:q:<priority>`` with the rotation cursor in
``jt:{s}:wrr``; ``jobtier job-format --upgrade`` (``store/lua/reformat.lua``) moves them into
the layout above, and processes refuse to start while any are left.

Job hashes (format 3). Besides ``id``, ``tenant``, ``payload``, ``result``, ``error``,
``progress``, the flow fields (``wf``, ``dd``, ...) and ``tp`` (the W3C traceparent of a
submit made inside a traced span, absent otherwise: runtime/tracing.py; optional, so no
format change) and ``h`` ("1" while the job is counted among its queue's jobs held behind a
concurrency key: lib.lua; optional too) and ``uq`` (a unique key's job: its key's record,
which it frees as it ends; ``U`` in ``wf`` until it finishes, ``u`` while it waits:
keyed.lua) and ``ex`` (its expiry, ms, when submitted with one: a claim that meets it past
that cancels it, claim.lua) and ``to`` (its own bound on an attempt, ms, when submitted
with one: the claim hands it to the worker in place of the task's), a job's small fields are
packed in
two values: ``c`` = ``"<type> <priority> <max attempts> <created ISO> <queue> <key>"`` (set
at creation; the priority and attempts change with a debounce's replacement, the priority
with ``set_priority.lua``) and ``t`` = ``"<state> <version> <attempt> <updated ms> <run-at ms>
<run-at ms>|<run-at ISO> <cancel 0/1> <lease version> <last logged version> <its time ms>
<worker>"``, space-separated (the last value of each is free text; empty values are empty).
No status document is stored: it is rendered from those fields when read
(``read_status.lua``, ``status/docs.py``), and is then byte for byte the one the transition
logged and published. ``store/format.py`` reads the packed values in Python (``job_fields``);
hashes of the formats before it (1: a field per value and the document in ``doc``; 2: ``c``,
``s`` and ``doc``) are read by no script: ``jobtier job-format --upgrade`` rewrites them.

Job ids are ``<ULID>-<shard>``: time-ordered, and any process routes them without a lookup.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable

from jobtier.core.names import JOB_ID_RE

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


# every pair of Crockford digits, by the 10 bits it encodes: a ULID's digits in 13 lookups
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]
_TIME_SHIFTS = (40, 30, 20, 10, 0)  # 48-bit time: 10 digits (50 bits, the top 2 zero)
_ENTROPY_SHIFTS = (70, 60, 50, 40, 30, 20, 10, 0)  # 80 bits: 16 digits
# each byte -> the Crockford digit of its low 5 bits: random bytes become random digits in
# one C call
_DIGIT_OF_BYTE = bytes.maketrans(
    bytes(range(256)), bytes(ord(_CROCKFORD[b & 31]) for b in range(256))
)
_last_ms: tuple[int, str] = (-1, "")  # the newest millisecond asked for, and its 10 digits


def _time_digits(ms: int) -> str:
    """The 10 digits of a 48-bit millisecond time; the last one is kept (a batch's ids share
    it), in one tuple swapped whole so that threads never see a torn pair."""
    global _last_ms
    last = _last_ms
    if last[0] != ms:
        p = _PAIRS
        last = (ms, "".join([p[(ms >> s) & 1023] for s in _TIME_SHIFTS]))
        _last_ms = last
    return last[1]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000 & 0xFFFF_FFFF_FFFF


def _fresh(ms: int, random: bytes) -> str:
    """A ULID of ``ms`` whose 16 entropy digits come from the first 16 bytes of ``random``."""
    return _time_digits(ms) + random[:16].translate(_DIGIT_OF_BYTE).decode()


def ulid(ms: int | None = None, entropy: bytes | None = None) -> str:
    """A ULID: 48-bit millisecond time and 80 bits of entropy, Crockford base32 (without
    ``entropy``, 16 random digits)."""
    ms = _now_ms() if ms is None else ms & 0xFFFF_FFFF_FFFF
    if entropy is None:
        return _fresh(ms, os.urandom(16))
    e = int.from_bytes(entropy, "big")
    p = _PAIRS
    return _time_digits(ms) + "".join([p[(e >> s) & 1023] for s in _ENTROPY_SHIFTS])


def _in_shard(name: str) -> Callable[[Keys, int], str]:
    """The method of a per-shard key, ``jt:{s}:<name>``."""

    def key(self: Keys, shard: int) -> str:
        return self._bases[shard] + name

    return key


def _of_job(kind: str) -> Callable[[Keys, str], str]:
    """The method of a job's own key, ``jt:{s}:<kind>:<id>`` in the shard of its id."""

    def key(self: Keys, job_id: str) -> str:
        return f"{self._bases[self.shard_of(job_id)]}{kind}:{job_id}"

    return key


class Keys:
    """Key and channel names for one deployment (prefix and shard count)."""

    __slots__ = ("_bases", "prefix", "shards")

    def __init__(self, prefix: str = "jt", shards: int = 16) -> None:
        self.prefix = prefix
        self.shards = shards
        self._bases = [f"{prefix}:{{{s}}}:" for s in range(shards)]

    # --- ids and routing ----------------------------------------------------------------
    def new_id(self, shard: int | None = None) -> str:
        """A new job id, ``<ULID>-<shard>``; a random shard unless one is given."""
        r = os.urandom(18)
        if shard is None:
            shard = (r[16] << 8 | r[17]) % self.shards
        return f"{_fresh(_now_ms(), r)}-{shard}"

    def shard_of(self, job_id: str) -> int:
        """The shard a job id routes to; ``ValueError`` for a malformed or foreign id."""
        if not JOB_ID_RE.fullmatch(job_id):
            raise ValueError(f"malformed job id: {job_id[:64]!r}")
        shard = int(job_id.rsplit("-", 1)[1])
        if shard >= self.shards:
            raise ValueError(f"job id {job_id!r} names shard {shard} of {self.shards}")
        return shard

    def valid_id(self, job_id: str) -> bool:
        try:
            self.shard_of(job_id)
        except ValueError:
            return False
        return True

    def shard_for(self, *parts: str) -> int:
        """A stable shard for a name (idempotency key, schedule id): crc32, same everywhere."""
        return zlib.crc32("\x00".join(parts).encode()) % self.shards

    # --- per-shard keys (the table above) ---------------------------------------------------
    def base(self, shard: int) -> str:
        """``jt:{s}:`` — the Lua scripts build job keys from it."""
        return self._bases[shard]

    def job_in(self, shard: int, job_id: str) -> str:
        return f"{self._bases[shard]}job:{job_id}"

    def ready(self, shard: int, queue: str, priority: str, tenant: str) -> str:
        return f"{self._bases[shard]}q:{queue}:{priority}:{tenant}"

    def ring(self, shard: int, queue: str, priority: str) -> str:
        return f"{self._bases[shard]}ring:{queue}:{priority}"

    def park(self, shard: int, queue: str, type: str) -> str:
        return f"{self._bases[shard]}park:{queue}:{type}"

    def home(self, queue: str) -> int:
        """The shard that keeps a queue's limits and permits (limit.lua)."""
        return self.shard_for("\x01queue", queue)

    def limit(self, queue: str) -> str:
        return f"{self._bases[self.home(queue)]}limit:{queue}"

    def permits(self, queue: str) -> str:
        return f"{self._bases[self.home(queue)]}permits:{queue}"

    def starts(self, queue: str) -> str:
        return f"{self._bases[self.home(queue)]}starts:{queue}"

    def ck(self, shard: int, tenant: str, key: str) -> str:
        return f"{self._bases[shard]}ck:{tenant}:{key}"

    def cron_def(self, shard: int, schedule_id: str) -> str:
        return f"{self._bases[shard]}cron:{schedule_id}"

    job = _of_job("job")
    lines = _of_job("lines")
    deps = _of_job("deps")
    dependents = _of_job("dnt")
    job_format = _in_shard("fmt")
    format_done = _in_shard("fmt:done")
    queue_counts = _in_shard("queues")
    parked = _in_shard("parked")
    ckeys = _in_shard("ckeys")
    sched = _in_shard("sched")
    active = _in_shard("active")
    dead = _in_shard("dead")
    waiting = _in_shard("waiting")
    log = _in_shard("log")
    log_refused = _in_shard("log:refused")
    cron = _in_shard("cron")
    events = _in_shard("ev")
    wake = _in_shard("wake")
    unlinked = _in_shard("unlinked")
    flow = _in_shard("flow")

    # --- global (not sharded) keys ------------------------------------------------------
    def workers(self) -> str:
        """hash worker id -> JSON heartbeat (tasks, concurrency, in-flight, last seen)."""
        return f"{self.prefix}:workers"

    def tasks(self) -> str:
        """hash task type -> JSON advert (queue, policies, payload schema): engine/catalog.py."""
        return f"{self.prefix}:tasks"

    def queue_limits(self) -> str:
        """hash queue -> JSON limits (concurrency, rate, period): the catalogue workers read
        to know which of their queues need permits; limit.lua holds the values it enforces."""
        return f"{self.prefix}:queues"

    def metrics(self) -> str:
        """hash process id -> JSON metrics snapshot (see metrics/snapshot.py)."""
        return f"{self.prefix}:metrics"

    def audit_pending(self) -> str:
        """list of admin-action records (JSON) waiting for Postgres (api/audit.py)."""
        return f"{self.prefix}:audit:pending"

    def webhook_tenants(self) -> str:
        """hash tenant -> "<ms>.<random>": tenants that may have webhook targets (a
        subscription or a job's callback), marked before and after the target is written,
        unmarked by the dispatchers once they have none; the dispatcher acknowledges the log
        entries of other tenants undecoded (webhooks/marks.py)."""
        return f"{self.prefix}:webhook-tenants"

    def persist_group(self) -> str:
        """The persisters' consumer group on every shard log."""
        return f"{self.prefix}-persister"

    def dispatch_group(self) -> str:
        """The webhook dispatchers' consumer group on every shard log, made before the first
        webhook or job callback is accepted (webhooks/callbacks.py)."""
        return f"{self.prefix}-dispatcher"

    def resolver_group(self) -> str:
        """The consumer group of the flow streams (flows/resolver.py)."""
        return f"{self.prefix}-resolver"
