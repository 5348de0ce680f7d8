"""The transition scripts as one Redis function library (store/scripts.py Library): what runs, and
what happens when Redis loses it. On the single Redis and on the Redis Cluster (``contract``)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import pytest
from redis.exceptions import ResponseError

from jobtier.config import Settings
from jobtier.core.errors import JobNotFound
from jobtier.core.model import JobSpec, State, Submitted
from jobtier.engine.queue import Queue
from jobtier.store.calls import submit_call
from jobtier.store.scripts import NAMES, Library, Script, library, run_scripts
from tests.fixtures.redis import (
    JOBTIER_PASSWORD,
    JOBTIER_USER,
    admin,
    command_calls,
    on_every_server,
)

pytestmark = pytest.mark.contract


async def _libraries(queue: Queue) -> list[dict[Any, Any]]:
    """FUNCTION LIST of every primary: per node, its libraries by name."""
    return [
        {lib[b"library_name"]: lib for lib in map(_pairs, reply)}
        for reply in await on_every_server(queue.redis, "FUNCTION", "LIST")
    ]


def _pairs(reply: Any) -> dict[Any, Any]:
    if isinstance(reply, dict):
        return reply
    return {reply[i]: reply[i + 1] for i in range(0, len(reply), 2)}


async def test_the_scripts_run_as_functions_of_one_library(queue: Queue) -> None:
    """Connecting loads the library on every primary, one function per script, and a
    transition runs by FCALL, not EVALSHA."""
    lib = library()
    assert set(lib.functions) == set(NAMES)
    for libraries in await _libraries(queue):
        functions = _pairs(libraries[lib.name.encode()])
        names = {_pairs(f)[b"name"].decode() for f in functions.get(b"functions", [])}
        assert names == set(lib.functions.values())
    before = await _script_calls(queue)
    sub = await queue.submit("echo", {"n": 1})
    after = await _script_calls(queue)
    assert after["fcall"] > before["fcall"] and after["evalsha"] == before["evalsha"]
    # (a status read is one script of its own, read_status.lua, sent by EVALSHA)
    assert (await queue.status(sub.job_id)).state is State.QUEUED


async def _script_calls(queue: Queue) -> dict[str, int]:
    """FCALL and EVALSHA calls so far, summed over the primaries (INFO commandstats)."""
    return {name: await command_calls(queue.redis, name) for name in ("fcall", "evalsha")}


async def test_a_lost_library_is_loaded_again_and_each_call_runs_once(queue: Queue) -> None:
    """After FUNCTION FLUSH (a Redis restarted without its data, a node new to the cluster),
    the refused calls are sent again once the library is loaded: a single call and a pipeline
    of calls on several shards each make their jobs once."""
    await queue.redis.function_flush()
    one = await queue.submit("echo", None)
    assert (await queue.status(one.job_id)).version == 1
    await queue.redis.function_flush()
    many = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(40)])
    assert len({queue.keys.shard_of(s.job_id) for s in many}) > 1  # several calls, one pipeline
    for sub in many:
        status = await queue.status(sub.job_id)
        assert (
            isinstance(sub, Submitted)
            and sub.created
            and status.state is State.QUEUED
            and status.version == 1
        )
    assert await queue.admin.waiting_by_tenant() == {"default": 41}  # each job counted once


def test_the_library_is_named_by_its_code() -> None:
    """Two builds of the same scripts give the same library (processes of one version share
    it); the name and the functions' names carry the code's digest, so another version's
    library sits beside it rather than replacing it."""
    a, b = Library(NAMES), Library(("submit", "claim"))
    assert Library(NAMES).name == a.name and a.code == library().code
    assert b.name != a.name and b.functions["submit"] != a.functions["submit"]
    assert a.code.startswith(f"#!lua name={a.name}\n")


async def test_a_library_one_node_lost_is_loaded_there_and_kept_elsewhere(queue: Queue) -> None:
    """The library deleted on one primary only: the calls refused there are sent again once
    it is loaded (without REPLACE: the nodes that have it keep it), and each job is made once;
    afterwards every primary has it."""
    lib = library()
    redis: Any = queue.redis
    if hasattr(redis, "get_primaries"):
        node = redis.get_primaries()[0]
        await redis.execute_command("FUNCTION DELETE", lib.name, target_nodes=node)
    else:
        await redis.execute_command("FUNCTION DELETE", lib.name)
    many = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(60)])
    for sub in many:
        status = await queue.status(sub.job_id)
        assert (
            isinstance(sub, Submitted)
            and sub.created
            and status.state is State.QUEUED
            and status.version == 1
        )
    assert await queue.admin.waiting_by_tenant() == {"default": 60}
    assert all(lib.name.encode() in libraries for libraries in await _libraries(queue))


async def test_a_call_refused_beside_a_failed_one_is_not_sent_again(queue: Queue) -> None:
    """One pipeline, two calls: one fails for real (a malformed call, its function loaded),
    the other is refused because Redis lost its script (SCRIPT FLUSH: the submit script by
    EVALSHA, as a process from before the library runs it). The error is raised and the
    refused call is not sent again: the caller, told the batch failed, sends it again, and
    no job was made that it does not know of."""
    await queue.redis.script_flush()
    item = queue.produce.prepare(JobSpec(type="echo", payload=1), "default")
    shard = queue.keys.shard_of(item.job_id)
    other = (shard + 1) % queue.keys.shards
    _, _, args = submit_call(shard, [item], 60_000)
    by_evalsha = Script("submit")  # no library: EVALSHA
    calls = [
        (queue.scripts["submit"], queue.scripts._argv(other, [60_000, 1])),  # one job, none given
        (by_evalsha, queue.scripts._argv(shard, args)),
    ]
    with pytest.raises(ResponseError):
        await run_scripts(queue.redis, calls)
    with pytest.raises(JobNotFound):
        await queue.status(item.job_id)
    assert await queue.admin.waiting_by_tenant() == {}
    await run_scripts(queue.redis, calls[1:])  # sent again: made once
    assert (await queue.status(item.job_id)).state is State.QUEUED


OLD = "jobtier_00000000deadbeef"  # a library as an earlier version left it


async def _jobtier(settings: Settings, *args: str) -> tuple[int, str]:
    env = {**os.environ, "JOBTIER_REDIS_URL": settings.redis_url,
           "JOBTIER_SHARDS": str(settings.shards),
           "JOBTIER_REDIS_CLUSTER": "true" if settings.redis_cluster else "false"}  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jobtier.cli.main", "scripts", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    async with asyncio.timeout(60):  # a CLI that hangs fails here, not the whole run
        out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


async def test_jobtier_scripts_lists_the_versions_libraries_and_prunes_the_others(
    settings: Settings, queue: Queue
) -> None:
    """`jobtier scripts` shows each primary's jobtier libraries, this version's marked;
    `--prune` deletes the others (an earlier version's) and leaves this version's and any
    library not jobtier's; jobs still run."""
    old = f"#!lua name={OLD}\nredis.register_function('jt_old_submit', function() return 1 end)"
    mine = "#!lua name=not_ours\nredis.register_function('not_ours_f', function() return 2 end)"
    await on_every_server(queue.redis, "FUNCTION", "LOAD", "REPLACE", old)
    await on_every_server(queue.redis, "FUNCTION", "LOAD", "REPLACE", mine)
    try:
        nodes = len(await on_every_server(queue.redis, "PING"))
        this = library().name
        code, out = await _jobtier(settings)
        assert code == 0, out
        assert out.count(f"{OLD}, {this} (this version)") == nodes, out
        assert "not_ours" not in out and f"{nodes} from other jobtier versions" in out, out

        code, out = await _jobtier(settings, "--prune")
        assert code == 0, out
        assert out.count(f"deleted {OLD}") == nodes and f"deleted {this}" not in out, out
        assert out.count(f"{this} (this version)") == nodes and "other jobtier" not in out, out
        for libraries in await _libraries(queue):
            assert set(libraries) == {this.encode(), b"not_ours"}
        sub = await queue.submit("echo", {"n": 1})
        assert (await queue.status(sub.job_id)).state is State.QUEUED
    finally:
        await on_every_server(queue.redis, "FUNCTION", "DELETE", "not_ours")


async def test_jobtier_scripts_says_what_redis_refused(settings: Settings, queue: Queue) -> None:
    """A user whose ACL lacks FUNCTION DELETE: the refusal is named as such (not as Redis
    being unreachable), and nothing is deleted."""
    old = f"#!lua name={OLD}\nredis.register_function('jt_old_submit', function() return 1 end)"
    await on_every_server(queue.redis, "FUNCTION", "LOAD", "REPLACE", old)
    async with admin(settings) as redis:
        await on_every_server(redis, "ACL", "SETUSER", "pruner", "on", "nopass", "~*", "&*",
                              "+@all", "-function|delete")  # fmt: skip
    try:
        url = settings.redis_url.replace(f"{JOBTIER_USER}:{JOBTIER_PASSWORD}@", "pruner:x@", 1)
        assert "pruner" in url, url
        code, out = await _jobtier(settings.replace(redis_url=url), "--prune")
        assert code == 1 and "Redis refused" in out and "no permissions" in out, out
        assert "needs FUNCTION LIST, and FUNCTION DELETE for --prune" in out, out
        assert "deleted" not in out and "unreachable" not in out, out
        for libraries in await _libraries(queue):
            assert OLD.encode() in libraries
    finally:
        async with admin(settings) as redis:
            await on_every_server(redis, "ACL", "DELUSER", "pruner")
        await on_every_server(queue.redis, "FUNCTION", "DELETE", OLD)


async def test_jobtier_scripts_says_when_redis_is_unreachable(settings: Settings) -> None:
    code, out = await _jobtier(settings.replace(redis_url="redis://127.0.0.1:1/0"), "--prune")
    assert code == 1 and "Redis unreachable" in out and "nothing changed" in out
