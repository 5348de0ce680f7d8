"""The Lua transitions: loaded once, one typed async wrapper per script.

Each script lives in ``store/lua/<name>.lua`` and opens with a header of its KEYS, ARGV and
returns; ``--!include lib.lua`` pulls in the shared helpers (lib.lua includes ``render.lua``
in turn). Wrappers take and return Python values and ``Code`` members, never bare integers.

The scripts that include lib.lua are loaded as one Redis function library (``Library``) and
run by FCALL: lib.lua's top level (its ~100 helpers and tables) then runs once, when the
library is loaded, where a script run by EVALSHA runs it at every call (~16 us of Redis CPU
a call; bench/lua_parts.py). Each function starts with lib.lua's ``begin(ARGV)``, which sets
what a call may change. The library's name and its functions' names carry a digest of its
code: processes of two versions (a rolling deploy) each call their own. A version's library
stays in Redis after its last process stops (one per deployed version; ``FUNCTION LIST``,
``FUNCTION DELETE`` to remove one no process runs).

Why not ``register_script()``: its pipeline path sends SCRIPT EXISTS before every pipeline
execution, a second round trip on the paths we batch (claim, complete, submit). We FCALL (or
EVALSHA) directly and, when Redis does not have the function or script (a Redis restarted
without its data, a node added to a cluster, FUNCTION FLUSH), load it and re-send only the
calls that were refused — they did not run, so re-sending them is safe.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError, ResponseError

from jobtier.core.errors import Code
from jobtier.core.keys import Keys
from jobtier.core.model import DEFAULT_QUEUE, ClaimedJob
from jobtier.store.redis import RedisClient

_INCLUDE = re.compile(r"^--!include (\S+)$", re.MULTILINE)
NAMES = (
    "submit", "claim", "heartbeat", "complete", "fail", "stopped",
    "cancel", "promote", "reclaim", "replay", "fire", "limit", "joblog", "purge",
    "link", "linked", "resolve", "reformat",
)  # fmt: skip


_LIB = "--!include lib.lua"
LIBRARIES = "jobtier_*"  # every jobtier version's function library (FUNCTION LIST LIBRARYNAME)


def _read(name: str) -> str:
    return (resources.files("jobtier.store") / "lua" / name).read_text()


def _expand(text: str, begin: str, read: Callable[[str], str] = _read) -> str:
    """``text`` with its includes expanded (an included file may include others: lib.lua
    includes render.lua), and ``begin`` after lib.lua's text; files come from ``read``."""

    def include(m: re.Match[str]) -> str:
        name = m.group(1)
        return _expand(read(name), "", read) + (begin if name == "lib.lua" else "")

    return _INCLUDE.sub(include, text)


def lua_source(name: str, read: Callable[[str], str] = _read) -> str:
    """The script as EVAL runs it: its includes expanded, and lib.lua's ``begin(ARGV)``
    called where lib.lua's text ends. ``read`` (a file's text by its name; this jobtier's
    by default) may give another revision's files: one whose lib.lua has no begin() (before
    the function library) gets no call of it."""
    has_begin = "local function begin(" in read("lib.lua")
    return _expand(read(f"{name}.lua"), "\nbegin(ARGV)" if has_begin else "", read)


# one script in the library: its function, which starts as the script did (begin(ARGV))
_WRAP = "\nredis.register_function('{function}', function(KEYS, ARGV)\n{body}\nend)\n"


class Library:
    """The scripts of ``names`` (each includes lib.lua) as one Redis function library: lib.lua
    once, then one function per script, ``function(KEYS, ARGV)`` around its code, which
    starts with ``begin(ARGV)`` where the script included lib.lua. ``read`` (a file's text by
    its name; this jobtier's by default) may give another revision's files (a benchmark's
    baseline)."""

    __slots__ = ("code", "functions", "name")

    def __init__(self, names: Sequence[str], read: Callable[[str], str] = _read) -> None:
        bodies = {}
        for name in names:
            text = read(f"{name}.lua")
            if text.count(_LIB) != 1:
                raise ValueError(f"{name}.lua must include lib.lua once to be in the library")
            bodies[name] = _expand(text.replace(_LIB, "begin(ARGV)"), "", read)
        lib = _expand(_LIB, "", read)
        # the digest covers the wrapper as well as the Lua: a change to either is a new name
        digest = hashlib.sha1("\0".join([_WRAP, lib, *bodies.values()]).encode()).hexdigest()[:16]
        self.name = f"jobtier_{digest}"
        self.functions = {name: f"jt_{digest}_{name}" for name in names}
        parts = [f"#!lua name={self.name}\n", lib]
        for name, body in bodies.items():
            parts.append(_WRAP.format(function=self.functions[name], body=body))
        self.code = "".join(parts)


_library: Library | None = None


def library() -> Library:
    """The library of every script in NAMES, built once per process."""
    global _library
    if _library is None:
        _library = Library(NAMES)
    return _library


class Script:
    """One script: its EVAL text and sha, and the function that runs it when it is in a
    library (``function``: FCALL is sent, else EVALSHA)."""

    __slots__ = ("function", "library", "name", "sha", "text")

    def __init__(self, name: str, lib: Library | None = None) -> None:
        self.name = name
        self.text = lua_source(name)
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()
        self.library = lib
        self.function = lib.functions[name] if lib is not None else None

    @property
    def unit(self) -> str:
        """What is loaded to run it: its library's name, or its sha."""
        return self.library.name if self.library is not None else self.sha

    def command(self) -> tuple[str, str]:
        return ("FCALL", self.function) if self.function else ("EVALSHA", self.sha)

    async def load(self, redis: RedisClient) -> None:
        """Load it (its library, or the script) on the server (every primary of a cluster)."""
        if self.library is not None:
            await load_library(redis, self.library)
        else:
            await redis.script_load(self.text)


async def _primaries(redis: RedisClient) -> list[tuple[str, dict[str, Any]]]:
    """Where a function command must go: every primary of a cluster (its 'host:port', and the
    keyword that sends a command there), or the one server ('', none)."""
    if not isinstance(redis, RedisCluster):
        return [("", {})]
    await redis.initialize()  # a client that has sent nothing yet knows no node
    return [(f"{n.host}:{n.port}", {"target_nodes": n}) for n in redis.get_primaries()]


async def load_library(redis: RedisClient, lib: Library) -> None:
    """FUNCTION LOAD ``lib`` on every primary that does not have it. Without REPLACE: Redis
    refuses a name it holds before it compiles anything, and a name stands for one code (its
    digest), so a node that has it is left as it is, and a fleet of processes starting at
    once costs Redis one compilation, not one each."""
    for _, where in await _primaries(redis):
        try:
            await redis.execute_command("FUNCTION LOAD", lib.code, **where)
        except ResponseError as exc:
            if "already exists" not in str(exc):
                raise


def _names(reply: Any) -> list[str]:
    """The library names in a FUNCTION LIST reply (RESP2: flat lists; RESP3: maps)."""
    names = []
    for lib in reply:
        fields = lib if isinstance(lib, dict) else dict(zip(lib[::2], lib[1::2], strict=True))
        name = fields.get(b"library_name", fields.get("library_name"))
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return sorted(names)


async def _listed(redis: RedisClient) -> list[tuple[str, dict[str, Any], list[str]]]:
    """Per primary: its 'host:port' ('' for a single server), where to send a command
    there, and the names of the jobtier libraries it holds."""
    out = []
    for node, where in await _primaries(redis):
        reply = await redis.execute_command("FUNCTION LIST", "LIBRARYNAME", LIBRARIES, **where)
        out.append((node, where, _names(reply)))
    return out


async def libraries(redis: RedisClient) -> list[tuple[str, list[str]]]:
    """The jobtier function libraries on each primary ('' for a single server): this
    version's, and those of versions that ran before (``prune_libraries``)."""
    return [(node, names) for node, _, names in await _listed(redis)]


async def prune_libraries(redis: RedisClient, keep: str, deleted: list[tuple[str, str]]) -> None:
    """FUNCTION DELETE every jobtier library but ``keep`` on every primary, appending (node,
    library) to ``deleted`` as each goes: a caller that meets an error half-way still knows
    what was done. Safe while a process of another version runs: its next call is refused
    as missing, and it loads its library again and sends the call again."""
    for node, where, names in await _listed(redis):
        for name in names:
            if name == keep:
                continue
            try:
                await redis.execute_command("FUNCTION DELETE", name, **where)
            except ResponseError as exc:
                if "not found" not in str(exc).lower():
                    raise
                continue  # deleted meanwhile by another prune
            deleted.append((node, name))


def _missing(exc: BaseException) -> bool:
    """Whether Redis refused a call because it does not have the script or function (the
    call did not run)."""
    return isinstance(exc, NoScriptError) or (
        isinstance(exc, ResponseError) and str(exc).startswith("Function not found")
    )


async def run_script(redis: RedisClient, script: Script, argv: Sequence[Any]) -> Any:
    """Run ``script`` (FCALL or EVALSHA) with ``argv`` (numkeys, keys, args); loads it and
    sends the call again when Redis does not have it (the call did not run)."""
    try:
        return await redis.execute_command(*script.command(), *argv)
    except ResponseError as exc:
        if not _missing(exc):
            raise
        await script.load(redis)
        return await redis.execute_command(*script.command(), *argv)


async def run_scripts(
    redis: RedisClient, calls: Sequence[tuple[Script, Sequence[Any]]]
) -> list[Any]:
    """Several script calls (FCALL or EVALSHA) in one pipeline (one round trip per node),
    their replies in order; the calls refused because Redis did not have their script or
    function are sent again, alone, once it is loaded (on every primary of a cluster).

    Any other error is raised at once, and the calls refused beside it are not sent again:
    the caller, told the batch failed, sends it again, and a call that never ran cannot have
    made a job it does not know of (a submit without an idempotency key) or a claim whose
    jobs it drops (their leases would hold them until they expire). The calls that ran
    beside the error did run: a claim's or a completion's are then refused as stale when
    sent again, and a submit's are why producers that care pass an idempotency key."""
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for _ in range(3):
        pipe = redis.pipeline(transaction=False)
        for i in todo:
            script, argv = calls[i]
            pipe.execute_command(*script.command(), *argv)
        replies = await pipe.execute(raise_on_error=False)
        retry = []
        for i, reply in zip(todo, replies, strict=True):
            if _missing(reply):
                retry.append(i)
            elif isinstance(reply, Exception):
                raise reply
            else:
                results[i] = reply
        if not retry:
            return results
        for script in {calls[i][0].unit: calls[i][0] for i in retry}.values():
            await script.load(redis)
        todo = retry
    # a RedisError, as any other failure of Redis: callers back off and try again
    raise RedisError("scripts keep disappearing from Redis (SCRIPT FLUSH in a loop?)")


# Made once per job on the submit path, these two are plain (not frozen) dataclasses: a frozen
# one's __init__ sets each field through object.__setattr__ (SubmitItem: 1.4 against 0.2 us,
# a tenth of a batch submit's producer CPU). Nothing changes them after they are made.
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

    def args(self) -> tuple[Any, ...]:
        return (
            self.job_id, self.tenant, self.type, self.queue, self.priority, self.payload,
            self.max_attempts, self.run_at_ms, self.delay_ms, self.idempotency_key,
            self.request_hash, self.concurrency_key, self.concurrency_limit, self.flow,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ClaimBatch:
    shard: int
    now_ms: int
    ready_left: int  # ready jobs still in the shard's served queues after this claim
    jobs: list[ClaimedJob]
    handed_back: list[str]  # ids of jobs of types the worker cannot run, left in their queue
    unaware: list[str]  # limited queues asked without a cap: take permits first (limit.lua)
    wake_at_ms: int = -1  # when the first block of a served queue ends (-1: none)


@dataclass(frozen=True, slots=True)
class Timed:
    """Result of promote/reclaim: how many moved, and when the next one falls due."""

    moved: int
    dead: int
    next_ms: int  # -1: nothing waiting
    now_ms: int


Call = tuple[Script, int, Sequence[Any]]

# a script's result code -> its Code member, by index (Code(n) is an enum look-up per job)
CODES = tuple(Code)


class Scripts:
    """Runs the transition scripts for one deployment (key layout) on one Redis client."""

    def __init__(self, redis: RedisClient, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        lib = library()
        self.by_name = {name: Script(name, lib) for name in NAMES}

    def __getitem__(self, name: str) -> Script:
        return self.by_name[name]

    async def load(self) -> None:
        """Load the library (FUNCTION LOAD, on every primary of a cluster), and any script
        that is not in it."""
        for script in {s.unit: s for s in self.by_name.values()}.values():
            await script.load(self.redis)

    # --- running ------------------------------------------------------------------------
    def _argv(self, shard: int, args: Sequence[Any]) -> tuple[Any, ...]:
        return (1, self.keys.log(shard), self.keys.base(shard), *args)

    async def call(self, script: Script, shard: int, args: Sequence[Any]) -> Any:
        return await run_script(self.redis, script, self._argv(shard, args))

    async def call_many(self, calls: Sequence[Call]) -> list[Any]:
        """Run several script calls in one pipeline (one round trip per node)."""
        if len(calls) == 1:
            script, shard, args = calls[0]
            return [await self.call(script, shard, args)]
        return await run_scripts(
            self.redis, [(script, self._argv(shard, args)) for script, shard, args in calls]
        )

    async def call_spread(self, calls: Sequence[Call], calls_per_pipeline: int) -> list[Any]:
        """Run independent calls (none reads what another writes: each on a shard of its
        own) in pipelines of ``calls_per_pipeline``, all at once; replies in order.

        One pipeline is packed whole before its first byte is sent, and Redis waits
        meanwhile. Several go out in turn: Redis runs the first while the rest are packed,
        and the client reads the first's replies while Redis runs the rest (a 500-job
        submit over 16 shards: bench/throughput.py's enqueue and end-to-end phases)."""
        if len(calls) <= calls_per_pipeline:
            return await self.call_many(calls)
        groups = [
            calls[i : i + calls_per_pipeline] for i in range(0, len(calls), calls_per_pipeline)
        ]
        # every pipeline runs to its end before an error is raised: none is left behind
        replies = await asyncio.gather(
            *(self.call_many(group) for group in groups), return_exceptions=True
        )
        out: list[Any] = []
        for group_replies in replies:
            if isinstance(group_replies, BaseException):
                raise group_replies
            out.extend(group_replies)
        return out

    # --- typed wrappers ------------------------------------------------------------------
    def submit_call(self, shard: int, items: Sequence[SubmitItem], idem_ttl_ms: int) -> Call:
        args: list[Any] = [idem_ttl_ms, len(items)]
        for item in items:
            args.extend(item.args())
        return (self["submit"], shard, args)

    @staticmethod
    def parse_submit(reply: list[Any]) -> list[SubmitOutcome]:
        return [
            SubmitOutcome(CODES[reply[i]], reply[i + 1].decode(), reply[i + 2] or b"")
            for i in range(0, len(reply), 3)
        ]

    def claim_call(
        self,
        shard: int,
        worker: str,
        count: int,
        lease_ms: int,
        queues: Sequence[tuple[str, int]] = ((DEFAULT_QUEUE, -1),),
        types: Sequence[str] = (),
    ) -> Call:
        """``queues``: (name, most jobs to take from it, -1 for no cap), in the order they
        share the call; ``types``: the task types the worker runs (empty: any, for tools)."""
        args: list[Any] = [worker, count, lease_ms, len(queues)]
        for name, cap in queues:
            args += (name, cap)
        args.append(len(types))
        args.extend(types)
        return (self["claim"], shard, args)

    @staticmethod
    def parse_claim(shard: int, reply: list[Any]) -> ClaimBatch:
        now, claimed, handed = int(reply[0]), int(reply[2]), int(reply[3])
        end = 6 + 9 * claimed
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
            )
            for i in range(6, end, 9)
        ]
        back = [r.decode() for r in reply[end : end + handed]]
        unaware = [r.decode() for r in reply[end + handed :]]
        return ClaimBatch(shard, now, int(reply[1]), jobs, back, unaware, int(reply[5]))

    async def claim(
        self,
        shard: int,
        worker: str,
        count: int,
        lease_ms: int,
        queues: Sequence[tuple[str, int]] = ((DEFAULT_QUEUE, -1),),
        types: Sequence[str] = (),
    ) -> ClaimBatch:
        reply = await self.call(*self.claim_call(shard, worker, count, lease_ms, queues, types))
        return self.parse_claim(shard, reply)

    def heartbeat_call(
        self,
        shard: int,
        worker: str,
        lease_ms: int,
        items: Sequence[tuple[str, int, bytes]],
        history_ms: int = 0,
    ) -> Call:
        """items: (job id, lease_version, progress JSON or b''). A progress change goes to
        the history only when the job's last logged entry is ``history_ms`` old (0: always)."""
        args: list[Any] = [worker, lease_ms, history_ms, len(items)]
        for item in items:
            args.extend(item)
        return (self["heartbeat"], shard, args)

    @staticmethod
    def parse_pairs(reply: list[Any]) -> list[tuple[Code, Any]]:
        return [(CODES[reply[i]], reply[i + 1]) for i in range(0, len(reply), 2)]

    def complete_call(
        self, shard: int, worker: str, retention_s: int, items: Sequence[tuple[str, int, bytes]]
    ) -> Call:
        """items: (job id, lease_version, result JSON or b'')."""
        args: list[Any] = [worker, retention_s, len(items)]
        for item in items:
            args.extend(item)
        return (self["complete"], shard, args)

    def fail_call(
        self,
        shard: int,
        worker: str,
        retention_s: int,
        items: Sequence[tuple[Any, ...]],
    ) -> Call:
        """items: (job id, lease_version, error JSON, retry delay ms or -1 for no retry[,
        refund: 1 when the attempt does not count])."""
        args: list[Any] = [worker, retention_s, len(items)]
        for item in items:
            args.extend(item)
            if len(item) == 4:
                args.append(0)
        return (self["fail"], shard, args)

    def stopped_call(
        self, shard: int, worker: str, retention_s: int, items: Sequence[tuple[str, int]]
    ) -> Call:
        """items: (job id, lease_version): cancelled if a cancel was requested, else released."""
        args: list[Any] = [worker, retention_s, len(items)]
        for item in items:
            args.extend(item)
        return (self["stopped"], shard, args)

    def joblog_call(
        self, shard: int, keep: int, items: Sequence[tuple[str, int, Sequence[bytes]]]
    ) -> Call:
        """items: (job id, ttl s, its new log lines); a job keeps its latest ``keep`` lines."""
        args: list[Any] = [keep, len(items)]
        for job_id, ttl, lines in items:
            args += (job_id, ttl, len(lines), *lines)
        return (self["joblog"], shard, args)

    async def cancel(
        self, shard: int, tenant: str, job_id: str, retention_s: int
    ) -> tuple[Code, bytes]:
        code, doc = await self.call(self["cancel"], shard, (tenant, job_id, retention_s))
        return Code(code), doc

    async def replay(self, shard: int, tenant: str, job_id: str) -> tuple[Code, bytes]:
        code, doc = await self.call(self["replay"], shard, (tenant, job_id))
        return Code(code), doc

    def purge_call(self, shard: int, queue: str, batch: int, budget: int, retention_s: int) -> Call:
        """Cancel up to ``batch`` of ``queue``'s ready jobs in ``shard`` (purge.lua); ``budget``
        -1 on a purge's first call. Reply: parse_purge."""
        return (self["purge"], shard, (queue, batch, budget, retention_s))

    @staticmethod
    def parse_purge(reply: list[Any]) -> tuple[int, int, int, int]:
        """(cancelled by the call, taken out of the lists, budget left, ready and parked jobs
        of the queue left in the shard)."""
        return int(reply[0]), int(reply[1]), int(reply[2]), int(reply[3])

    def promote_call(self, shard: int, limit: int) -> Call:
        return (self["promote"], shard, (limit,))

    def reclaim_call(self, shard: int, limit: int, retention_s: int, dead_s: int) -> Call:
        return (self["reclaim"], shard, (limit, retention_s, dead_s))

    # --- flows (lib.lua's flows section) --------------------------------------------------
    def link_call(self, shard: int, tenant: str, links: Sequence[tuple[str, str]]) -> Call:
        """links: (dependency id of this shard, dependent id)."""
        args: list[Any] = [tenant, len(links)]
        for link in links:
            args.extend(link)
        return (self["link"], shard, args)

    def linked_call(self, shard: int, dependents: Sequence[str], head: str = "") -> Call:
        return (self["linked"], shard, [head, len(dependents), *dependents])

    def resolve_call(
        self, shard: int, retention_s: int, items: Sequence[tuple[str, str, str, str, bytes]]
    ) -> Call:
        """items: (kind 'r' or 'x', target id of this shard, source id, state, data)."""
        args: list[Any] = [retention_s, len(items)]
        for item in items:
            args.extend(item)
        return (self["resolve"], shard, args)

    @staticmethod
    def parse_promote(reply: list[Any]) -> Timed:
        return Timed(int(reply[0]), 0, int(reply[1]), int(reply[2]))

    @staticmethod
    def parse_reclaim(reply: list[Any]) -> Timed:
        return Timed(int(reply[0]), int(reply[1]), int(reply[2]), int(reply[3]))
