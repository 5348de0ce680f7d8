"""The Lua transitions: loaded once, run by name.

Each script lives in ``store/lua/<name>.lua`` and opens with a header of its KEYS, ARGV and
returns; ``--!include lib.lua`` pulls in the shared helpers (lib.lua includes ``render.lua``).

The scripts that include lib.lua are loaded as one Redis function library (``Library``) and
run by FCALL, so lib.lua's top level runs once at load rather than at every EVALSHA. Each
function starts with lib.lua's ``begin(ARGV)``. The library's and functions' names carry a
digest of its code: two versions in a rolling deploy each call their own (an old version's
library stays until ``prune_libraries`` deletes it).

Not ``register_script()``: its pipelines send SCRIPT EXISTS first, a second round trip on the
batched paths. We FCALL (or EVALSHA) directly and, when Redis lacks the function (restarted
without its data, a new cluster node, FUNCTION FLUSH), load it and re-send only the refused
calls: they did not run, so re-sending them is safe.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.exceptions import (
    AskError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier.core.errors import Code
from jobtier.core.keys import Keys
from jobtier.store import calls
from jobtier.store.calls import Call, ClaimBatch
from jobtier.store.durable import Durable, current, marker
from jobtier.store.faults import connection_closed_under_it
from jobtier.store.redis import RedisClient, by_node, commands_each

_INCLUDE = re.compile(r"^--!include (\S+)$", re.MULTILINE)
_SCRIPTS = (  # store/lua/<name>.lua of every transition script
    "submit claim heartbeat complete fail stopped cancel promote promote_job set_priority reclaim"
    " replay fire limit"
    " joblog purge link linked resolve reformat explain keyed breaker"
    " batch_submit batch_seal batch_done batch_cancel batch_retry batch_expire reconcile"
)
NAMES = tuple(_SCRIPTS.split())
# scripts that only read: their functions carry the no-writes flag and run by FCALL_RO (Redis
# refuses any write in them, and runs them where only reads may run)
READ_ONLY = frozenset({"explain"})
_LIB = "--!include lib.lua"
_LIB_LINE = re.compile(r"^--!include lib\.lua$", re.MULTILINE)
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
    called where lib.lua's text ends; what follows it runs inside lib.lua's ``logged``, which
    appends the call's log entries when it ends (``_LOGGED``). ``read`` (a file's text by
    name) may give another revision's files; one whose lib.lua has no begin() gets no call of
    it, and none without logged() is wrapped."""
    lib = read("lib.lua")
    begin = "\nbegin(ARGV)" if "local function begin(" in lib else ""
    text = read(f"{name}.lua")
    if "local function logged(" in lib and name not in READ_ONLY and _LIB_LINE.search(text):
        head, body = _logged(text)
        text = f"{head}{_LIB}\n{body}"
        begin = ""  # in the wrapped body, first
    text = _expand(text, begin, read)
    return "#!lua flags=no-writes\n" + text if name in READ_ONLY else text


# A script's body, after lib.lua: begun, run, and its log entries appended at its end whether
# it returned or failed (lib.lua's logged()). One closure a call: nothing else it allocates.
_LOGGED = "return logged(pcall(function()\nbegin(ARGV)\n{body}\nend))\n"


def _logged(text: str) -> tuple[str, str]:
    """(what a script has before its include of lib.lua, the rest wrapped in ``_LOGGED``)."""
    head, rest = _LIB_LINE.split(text, 1)
    return head, _LOGGED.format(body=rest)


_WRAP = "\nredis.register_function('{function}', function(KEYS, ARGV)\n{body}\nend)\n"
_WRAP_RO = (
    "\nredis.register_function{{function_name='{function}', flags={{'no-writes'}},"
    " callback=function(KEYS, ARGV)\n{body}\nend}}\n"
)


class Library:
    """The scripts of ``names`` (each includes lib.lua) as one Redis function library: lib.lua
    once, then one function per script, which calls ``begin(ARGV)`` where the script included
    lib.lua and runs the rest inside ``logged`` (``_LOGGED``). ``read`` may give another
    revision's files (a benchmark's baseline)."""

    __slots__ = ("code", "functions", "name")

    def __init__(self, names: Sequence[str], read: Callable[[str], str] = _read) -> None:
        bodies = {}
        wrapped = "local function logged(" in read("lib.lua")  # (not an older revision's)
        for name in names:
            text = read(f"{name}.lua")
            if text.count(_LIB) != 1:
                raise ValueError(f"{name}.lua must include lib.lua once to be in the library")
            if name in READ_ONLY or not wrapped:
                body = text.replace(_LIB, "begin(ARGV)")
            else:
                body = "".join(_logged(text))
            bodies[name] = _expand(body, "", read)
        lib = _expand(_LIB, "", read)
        # the digest covers the wrapper as well as the Lua: a change to either is a new name
        wraps = "\0".join([_WRAP, _WRAP_RO])
        digest = hashlib.sha1("\0".join([wraps, lib, *bodies.values()]).encode()).hexdigest()[:16]
        self.name = f"jobtier_{digest}"
        self.functions = {name: f"jt_{digest}_{name}" for name in names}
        parts = [f"#!lua name={self.name}\n", lib]
        for name, body in bodies.items():
            wrap = _WRAP_RO if name in READ_ONLY else _WRAP
            parts.append(wrap.format(function=self.functions[name], body=body))
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
        read_only = self.name in READ_ONLY
        if self.function:
            return ("FCALL_RO" if read_only else "FCALL", self.function)
        return ("EVALSHA_RO" if read_only else "EVALSHA", self.sha)

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
    """FUNCTION LOAD ``lib`` on every primary that does not have it. Without REPLACE: a name
    stands for one code (its digest), and Redis refuses a name it holds before compiling, so
    a fleet of processes starting at once costs one compilation, not one each."""
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
    library) to ``deleted`` as each goes (a caller that meets an error still knows what was
    done). Safe while another version runs: it loads its library again when refused."""
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
    """Whether Redis refused a call for want of its script or function (it did not run)."""
    return isinstance(exc, NoScriptError) or (
        isinstance(exc, ResponseError) and str(exc).startswith("Function not found")
    )


async def run_script(redis: RedisClient, script: Script, argv: Sequence[Any]) -> Any:
    """Run ``script`` with ``argv`` (numkeys, keys, args), loading it first if Redis lacks it."""
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
    """Several script calls in one pipeline (one round trip per node), replies in order; the
    calls refused for want of their script are sent again once it is loaded.

    Any other error is raised, and the refused calls beside it (on any node) are not sent
    again: the caller, told the batch failed, sends it again, so a call that never ran
    cannot have made a job or a claim the caller does not know of. Calls that ran beside the
    error (on a cluster node that answered) are refused as stale when sent again
    (completions), answer as they did (a claim sent again with its token: claim.lua), or are
    made idempotent by a key (submits). ``run_scripts_each`` tells apart the calls that
    failed from those that ran."""
    results = await run_scripts_each(redis, calls, resend_beside_errors=False)
    for reply in results:
        if isinstance(reply, Exception):
            raise reply
    return results


async def run_scripts_each(
    redis: RedisClient,
    calls: Sequence[tuple[Script, Sequence[Any]]],
    *,
    resend_beside_errors: bool = True,
) -> list[Any]:
    """``run_scripts``, but a failed call's reply is its exception, in its place, and the
    calls refused for want of their script are sent again even beside failed ones (the
    caller sees each call's outcome); ``resend_beside_errors=False``: not then. Inside
    ``redis.sent_once`` never sent again by the client library when a connection fails.

    On a cluster the calls go in one pipeline per node, side by side, each sent once (no
    retry sleeps in the client): a node that is down (a master failing over) fails only its
    own calls, at once, and the others' replies come back."""
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(3):
        replies = await _send(redis, [calls[i] for i in todo])
        retry: list[int] = []
        failed: Exception | None = None
        for i, reply in zip(todo, replies, strict=True):
            if _missing(reply):
                retry.append(i)
            elif isinstance(reply, Exception):
                failed = failed or reply
            results[i] = reply
        if not retry:
            return results
        if failed is not None and not resend_beside_errors:
            for i in retry:
                results[i] = failed  # not sent again (run_scripts' docstring)
            return results
        try:
            await _load_refused(redis, [calls[i] for i in retry], everywhere=attempt > 0)
        except RedisError as exc:
            for i in retry:
                results[i] = exc
            return results
        todo = retry
    # a RedisError, as any other failure of Redis: callers back off and try again
    error = RedisError("scripts keep disappearing from Redis (SCRIPT FLUSH in a loop?)")
    for i in todo:
        results[i] = error
    return results


async def _send(redis: RedisClient, calls: Sequence[tuple[Script, Sequence[Any]]]) -> list[Any]:
    """The calls' replies in order, an exception in place of a failed call's (``commands_each``:
    one pipeline, one per node of a cluster)."""
    commands = [(*script.command(), *argv) for script, argv in calls]
    return await commands_each(redis, commands, _routed_by)


def _routed_by(command: Sequence[Any]) -> Any:
    """The key a script's command (FCALL or EVALSHA, its name, then its arguments) is routed
    by: its first key, if any."""
    return _key(command[2:])


def _key(argv: Sequence[Any]) -> Any:
    """The key a call's arguments are routed by: the first after the number of keys, if any."""
    return argv[1] if argv and int(argv[0]) > 0 else None


def _by_node(
    redis: RedisCluster, calls: Sequence[tuple[Script, Sequence[Any]]]
) -> list[tuple[ClusterNode | None, list[int]]]:
    return by_node(redis, [_key(argv) for _, argv in calls])


async def _load_refused(
    redis: RedisClient, refused: Sequence[tuple[Script, Sequence[Any]]], *, everywhere: bool
) -> None:
    """Load the scripts of the ``refused`` calls: on a cluster, on the nodes that refused
    them (a node down elsewhere must not stop the load where it is needed), or
    ``everywhere`` (``Script.load``: a call may have been redirected)."""
    if everywhere or not isinstance(redis, RedisCluster):
        for script in {s.unit: s for s, _ in refused}.values():
            await script.load(redis)
        return
    for node, at in _by_node(redis, refused):
        for script in {refused[i][0].unit: refused[i][0] for i in at}.values():
            await _load_on(redis, script, node)


async def _load_on(redis: RedisClient, script: Script, node: ClusterNode | None) -> None:
    """Load ``script`` on cluster ``node`` only (or everywhere: ``Script.load``)."""
    if node is None:
        await script.load(redis)
    elif script.library is not None:
        try:
            await redis.execute_command("FUNCTION LOAD", script.library.code, target_nodes=node)
        except ResponseError as exc:
            if "already exists" not in str(exc):
                raise
    else:
        await redis.execute_command("SCRIPT LOAD", script.text, target_nodes=node)


_REDIRECTED = (MovedError, AskError, TryAgainError)  # refused by a node: it did not run
DURABLE_ATTEMPTS = 5  # sends of a durable call whose slot is moving (run_durably)
DURABLE_PAUSE = 0.02  # seconds before the second, doubled before each later one (20-160 ms)


async def _send_waiting(
    redis: RedisClient, commands: Sequence[Sequence[Any]], bases: Sequence[str], durable: Durable
) -> list[Any]:
    """Send ``commands`` (``bases[i]``: the base key of command i's shard), each node's
    followed by the marker write and WAIT on the same connection; replies in order, errors
    in place. Each WAIT's count goes to ``durable`` (an error in place of a count: 0)."""
    wait = ("WAIT", durable.wanted, durable.timeout_ms)
    if not isinstance(redis, RedisCluster):
        # a pipeline is sent on one connection (retried whole on a new one after an error)
        pipe = redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        pipe.execute_command(*marker(bases[0]))
        pipe.execute_command(*wait)
        replies = await pipe.execute(raise_on_error=False)
        _count(durable, replies[-1])
        return list(replies[: len(commands)])
    await redis.initialize()
    groups: dict[str, tuple[ClusterNode, list[PipelineCommand]]] = {}
    for i, (command, base) in enumerate(zip(commands, bases, strict=True)):
        node = redis.nodes_manager.get_node_from_slot(redis.keyslot(base))
        groups.setdefault(node.name, (node, []))[1].append(PipelineCommand(i, *command))
    for _, group in groups.values():
        key = bases[group[0].position]
        group += [PipelineCommand(-1, *marker(key)), PipelineCommand(-1, *wait)]
    # a node's commands go on one of its connections, in order: WAIT after the calls. Every
    # node's pipeline runs to its end before a failure is raised: none is left running
    sent = await asyncio.gather(
        *(node.execute_pipeline(group) for node, group in groups.values()),
        return_exceptions=True,
    )
    for result in sent:
        if isinstance(result, BaseException):
            if connection_closed_under_it(result):  # a refresh recycled it mid-send
                redis._initialize = True
                raise RedisConnectionError(f"connection closed under the call: {result}") from (
                    result
                )
            if isinstance(result, (ConnectionError, OSError, RedisError)):
                redis._initialize = True  # learn the topology again before the next command
            raise result
    out: list[Any] = [None] * len(commands)
    for _, group in groups.values():
        for cmd in group[:-2]:
            out[cmd.position] = cmd.result
        _count(durable, group[-1].result)
    return out


def _count(durable: Durable, reply: Any) -> None:
    durable.saw(reply if isinstance(reply, int) else 0)


async def run_durably(
    redis: RedisClient, calls: Sequence[tuple[Script, Sequence[Any]]], durable: Durable
) -> list[Any]:
    """``run_scripts`` with WAIT after each node's calls (``store/durable.py``): the calls
    refused for want of their script, or by a node that no longer serves their slot, are
    sent again (with their WAIT), after a pause that grows while slots move; any other error
    is raised, as ``run_scripts`` does. Slots still moving after the last attempt raise the
    last refusal (TRYAGAIN, ASK, MOVED): a failover or migration under way, a 503 to retry."""
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    redirected: Exception | None = None
    for attempt in range(DURABLE_ATTEMPTS):
        if redirected is not None and attempt:
            await asyncio.sleep(DURABLE_PAUSE * 2 ** (attempt - 1))
        commands = [(*calls[i][0].command(), *calls[i][1]) for i in todo]
        bases = [str(calls[i][1][2]) for i in todo]  # argv: numkeys, log key, base key, ...
        replies = await _send_waiting(redis, commands, bases, durable)
        retry, moved, missing = [], False, {}
        for i, reply in zip(todo, replies, strict=True):
            if _missing(reply):
                missing[calls[i][0].unit] = calls[i][0]
                retry.append(i)
            elif isinstance(reply, _REDIRECTED):
                moved = True
                redirected = reply
                retry.append(i)
            elif isinstance(reply, Exception):
                raise reply
            else:
                results[i] = reply
        if not retry:
            return results
        if moved and isinstance(redis, RedisCluster):
            await redis.nodes_manager.initialize()
        for script in missing.values():
            await script.load(redis)
        if not moved:
            redirected = None  # only a missing script this time: sent again at once
        todo = retry
    if redirected is not None:
        raise redirected
    raise RedisError("scripts keep disappearing from Redis")


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

    def _argv(self, shard: int, args: Sequence[Any]) -> tuple[Any, ...]:
        return (1, self.keys.log(shard), self.keys.base(shard), *args)

    async def call(self, script: Script | str, shard: int, args: Sequence[Any]) -> Any:
        """Run one script (by name, or a ``Script``) on ``shard``."""
        if isinstance(script, str):
            script = self.by_name[script]
        durable = current()
        if durable is not None and script.name not in READ_ONLY:
            (reply,) = await run_durably(self.redis, [(script, self._argv(shard, args))], durable)
            return reply
        return await run_script(self.redis, script, self._argv(shard, args))

    async def call_many(self, calls: Sequence[Call]) -> list[Any]:
        """Run several script calls in one pipeline (one round trip per node)."""
        if len(calls) == 1:
            script, shard, args = calls[0]
            return [await self.call(script, shard, args)]
        by_name = self.by_name
        prepared = [(by_name[name], self._argv(shard, args)) for name, shard, args in calls]
        durable = current()
        if durable is not None and any(s.name not in READ_ONLY for s, _ in prepared):
            return await run_durably(self.redis, prepared, durable)
        return await run_scripts(self.redis, prepared)

    async def confirm(self, shards: Sequence[int]) -> None:
        """While a durable submit runs: the marker write and WAIT on the nodes of ``shards``,
        for a submit that wrote nothing itself (an idempotent repeat), whose first writes may
        still be on the master alone, or for a write made without a script (a batch's
        idempotency key) on a node none of the submit's scripts ran on (``store/durable.py``)."""
        durable = current()
        if durable is None or not shards:
            return
        bases = [self.keys.base(shard) for shard in shards]
        for reply in await _send_waiting(self.redis, [marker(b) for b in bases], bases, durable):
            if isinstance(reply, Exception):
                raise reply

    async def write(self, shard: int, *command: Any) -> Any:
        """A plain write command on ``shard`` (its key in the shard's slot), followed by WAIT
        while a durable submit runs (``store/durable.py``)."""
        durable = current()
        if durable is None:
            return await self.redis.execute_command(*command)
        (reply,) = await _send_waiting(self.redis, [command], [self.keys.base(shard)], durable)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def call_many_each(self, calls: Sequence[Call]) -> list[Any]:
        """``call_many``, a failed call's reply its exception (``run_scripts_each``): on a
        cluster, the calls of a node that is down fail, the others' replies come back."""
        by_name = self.by_name
        return await run_scripts_each(
            self.redis, [(by_name[name], self._argv(shard, args)) for name, shard, args in calls]
        )

    async def call_spread(self, calls: Sequence[Call], calls_per_pipeline: int) -> list[Any]:
        """Run independent calls (each on a shard of its own) in pipelines of
        ``calls_per_pipeline``, all at once; replies in order. Redis runs the first pipeline
        while the rest are packed, where one pipeline is packed whole before it is sent."""
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

    async def claim(self, shard: int, *args: Any, **options: Any) -> ClaimBatch:
        """A claim on ``shard`` (after it, ``calls.claim_call``'s arguments), its reply parsed:
        for tests and tools (a worker's claims go through ``call_many``)."""
        reply = await self.call(*calls.claim_call(shard, *args, **options))
        return calls.parse_claim(shard, reply)

    async def cancel(
        self, shard: int, tenant: str, job_id: str, retention_s: int
    ) -> tuple[Code, bytes]:
        return calls.parse_code_doc(
            await self.call(*calls.cancel_call(shard, tenant, job_id, retention_s))
        )

    async def replay(self, shard: int, tenant: str, job_id: str) -> tuple[Code, bytes]:
        return calls.parse_code_doc(await self.call(*calls.replay_call(shard, tenant, job_id)))
