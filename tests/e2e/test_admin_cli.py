"""``jobtier jobs``, ``jobtier dead-letters`` and ``jobtier queues``: the real command, run as a
subprocess against a real API (loopback uvicorn, Redis, Postgres), with a real worker and
persister; and the same operations through ``AsyncClient``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobtier.api.records import PostgresExtension
from jobtier.client import AsyncClient, ValidationFailed, WrongState
from jobtier.config import Settings
from jobtier.core.model import State
from jobtier.engine.catalog import publish
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from tests.debug_tasks import gate, registry
from tests.fixtures.api import ADMIN, KEYS, ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings, queue: Queue) -> ApiServer:
    # in the catalogue before the API loads it, as if their workers ran
    await publish(queue.redis, queue.keys, [t.ad("tests") for t in registry])
    return await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)


@pytest.fixture
async def persister(pg_settings: Settings, queue: Queue, pg_pool: Pool) -> AsyncIterator[Persister]:
    yield Persister(pg_settings, queue.redis, pg_pool, "test-persister")


class Cli:
    """``python -m jobtier.cli.main`` with ``JOBTIER_URL`` and ``JOBTIER_KEY`` (and
    ``JOBTIER_ADMIN_KEY`` when given) set, nothing else of jobtier's from this environment."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api

    async def __call__(
        self, *args: str, key: str | None = KEYS["acme"], admin_key: str | None = None
    ) -> tuple[int, str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
        env["JOBTIER_URL"] = self.api.url
        if key is not None:
            env["JOBTIER_KEY"] = key
        if admin_key is not None:
            env["JOBTIER_ADMIN_KEY"] = admin_key
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "jobtier.cli.main", *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def json(self, *args: str, key: str | None = KEYS["acme"]) -> Any:
        code, out, err = await self(*args, "--json", key=key)
        assert code == 0, err
        return json.loads(out)


async def until(queue: Queue, job_id: str, state: State) -> None:
    async def reached() -> bool:
        return (await queue.status(job_id)).state is state

    await wait_for(reached, 20)


async def test_jobs_list_show_logs_cancel_retry(
    pg_api: ApiServer, queue: Queue, persister: Persister, background: Background
) -> None:
    cli = Cli(pg_api)
    async with pg_api.client() as c:
        chatty = (await c.post("/v1/jobs", json={"type": "chatty", "payload": {"n": 2}})).json()
        broken = (await c.post("/v1/jobs", json={"type": "deep_failure"})).json()
        waiting = (await c.post("/v1/jobs", json={"type": "wait_for_cancel"})).json()
    queue.produce.tasks = registry
    background.start(worker_for(queue, registry))
    await until(queue, chatty["id"], State.SUCCEEDED)
    await until(queue, broken["id"], State.FAILED)
    await until(queue, waiting["id"], State.RUNNING)

    # cancel a running job: the worker stops it at once
    code, out, err = await cli("jobs", "cancel", waiting["id"])
    assert code == 0 and "cancel requested" in out, err
    await until(queue, waiting["id"], State.CANCELLED)
    await persister.drain()

    # list: a table for people, JSON for scripts, filters
    code, out, _ = await cli("jobs", "list")
    assert code == 0 and out.splitlines()[0].split()[:4] == ["ID", "TYPE", "QUEUE", "STATE"]
    assert all(j["id"] in out for j in (chatty, broken, waiting))
    page = await cli.json("jobs", "list", "--state", "failed", "--since", "1h")
    assert [j["id"] for j in page["jobs"]] == [broken["id"]]
    assert (await cli.json("jobs", "list", "--since", "2999-01-01T00:00:00Z"))["jobs"] == []
    page = await cli.json("jobs", "list", "--limit", "1")
    assert len(page["jobs"]) == 1 and page["next_cursor"]
    code, out, _ = await cli("jobs", "list", "--limit", "1")
    assert f"--cursor {page['next_cursor']}" in out

    # show: the error with its traceback, the history from Postgres (which kept it too)
    code, out, _ = await cli("jobs", "show", broken["id"])
    assert code == 0 and "state:       failed" in out and "error:       ValueError" in out
    assert "traceback:" in out and "KeyError: 'missing'" in out and "running -> failed" in out
    shown = await cli.json("jobs", "show", broken["id"])
    (failed,) = [t for t in shown["history"] if t["to_state"] == "failed"]
    assert failed["error"] == shown["status"]["error"]
    last = failed["error"]["traceback"].rstrip().splitlines()[-1]
    assert last.startswith("ValueError: the record is incomplete xxx")
    shown = await cli.json("jobs", "show", waiting["id"])
    assert shown["status"]["error"]["type"] == "Cancelled"
    code, out, _ = await cli("jobs", "show", waiting["id"])  # the request is named as such
    (asked,) = [line for line in out.splitlines() if "cancel requested" in line.split("  ")]
    assert code == 0 and asked.split()[-3] == "api" and "running -> running" not in out, out

    # logs
    code, out, _ = await cli("jobs", "logs", chatty["id"])
    assert code == 0 and "line 0" in out and "line 1" in out and "#1" in out
    lines = await cli.json("jobs", "logs", chatty["id"])
    assert [line["message"] for line in lines] == ["line 0", "line 1", "done"]
    assert (await cli.json("jobs", "show", chatty["id"]))["result"] == "logged"

    # retry: a failed job only
    code, out, err = await cli("jobs", "retry", chatty["id"])
    assert code == 1 and "has not failed (succeeded)" in err and "HTTP 409" in err
    retried = await cli.json("jobs", "retry", broken["id"])
    assert retried["state"] in ("queued", "running", "failed") and retried["attempt"] == 0

    # another tenant sees none of it; wrong or missing keys are clear errors
    code, _, err = await cli("jobs", "show", broken["id"], key=KEYS["globex"])
    assert code == 1 and "HTTP 404" in err
    code, _, err = await cli("jobs", "list", key="no-such-key")
    assert code == 1 and "HTTP 401" in err and "needs a tenant's API key" in err
    code, _, err = await cli("jobs", "list", key=None)
    assert code == 2 and "no API key: pass --key or set JOBTIER_KEY" in err
    code, _, err = await cli("jobs", "list", "--since", "yesterday")
    assert code == 2 and "neither an ISO 8601 time" in err


async def test_dead_letters_list_show_replay(pg_api: ApiServer, queue: Queue) -> None:
    cli = Cli(pg_api)
    async with pg_api.client() as c:
        deep = (await c.post("/v1/jobs", json={"type": "deep_failure", "payload": {"k": 1}})).json()
        fatal = (await c.post("/v1/jobs", json={"type": "fail", "payload": {"fatal": True}})).json()
    from tests.tasks import registry as test_registry

    queue.produce.tasks = None
    await worker_for(queue, test_registry, burst=True).run()  # fail
    await worker_for(queue, registry, burst=True).run()  # deep_failure

    # the admin key is needed, and the message says so (once)
    code, _, err = await cli("dead-letters", "list")
    assert code == 1 and "HTTP 403" in err and "needs the admin key" in err
    assert err.count("admin key") == 1 and "the key from JOBTIER_KEY is not it" in err, err
    assert "(give it in --key or JOBTIER_ADMIN_KEY)" in err, err
    # the exports `jobtier run` prints: JOBTIER_KEY a tenant's, JOBTIER_ADMIN_KEY the admin key;
    # admin commands take the latter, and no httpx line per request on stderr
    code, out, err = await cli("dead-letters", "list", admin_key=ADMIN)
    assert code == 0 and deep["id"] in out and err == "", err
    code, _, err = await cli("dead-letters", "list", "--key", KEYS["acme"], admin_key=ADMIN)
    assert code == 1 and "HTTP 403" in err and "from --key" in err  # an explicit --key wins

    code, out, _ = await cli("dead-letters", "list", key=ADMIN)
    assert code == 0 and deep["id"] in out and fatal["id"] in out and "ValueError" in out
    listed = await cli.json("dead-letters", "list", "--type", "deep_failure", key=ADMIN)
    assert [j["id"] for j in listed] == [deep["id"]]
    assert listed[0]["error"]["traceback"]
    assert len(await cli.json("dead-letters", "list", "--since", "10m", key=ADMIN)) == 2
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert await cli.json("dead-letters", "list", "--since", future, key=ADMIN) == []

    code, out, _ = await cli("dead-letters", "show", deep["id"], key=ADMIN)
    assert code == 0 and "traceback:" in out and 'payload:     {"k":1}' in out
    shown = await cli.json("dead-letters", "show", deep["id"], key=ADMIN)
    assert shown["payload"] == {"k": 1} and shown["job"]["state"] == "failed"

    # a replay of every dead letter is asked for by name (--all), not by leaving filters out
    code, _, err = await cli("dead-letters", "replay", key=ADMIN)
    assert code == 2 and "--all to replay every dead letter" in err
    assert len(await cli.json("dead-letters", "list", key=ADMIN)) == 2  # none replayed
    # replay by filter: nothing since the future, then the one of its type
    nothing = await cli.json("dead-letters", "replay", "--since", future, key=ADMIN)
    assert nothing == {"replayed": [], "count": 0, "skipped": []}
    replayed = await cli.json(
        "dead-letters", "replay", "--type", "fail", "--since", "1h", key=ADMIN
    )
    assert replayed == {"replayed": [fatal["id"]], "count": 1, "skipped": []}
    code, _, err = await cli("dead-letters", "replay", deep["id"], "--all", key=ADMIN)
    assert code == 2 and "not both" in err
    code, out, _ = await cli("dead-letters", "replay", deep["id"], key=ADMIN)
    assert code == 0 and f"{deep['id']}: queued again" in out
    code, _, err = await cli("dead-letters", "replay", deep["id"], "--type", "x", key=ADMIN)
    assert code == 2 and "not both" in err
    code, _, err = await cli("dead-letters", "show", deep["id"], key=ADMIN)
    assert code == 1 and "not in the dead-letter set" in err


async def test_job_text_reaches_the_terminal_as_text(pg_api: ApiServer, queue: Queue) -> None:
    """A job's error and log lines are anyone's text (a worker's, an HTTP worker's): the
    commands print their escape sequences, carriage returns, NUL and line breaks as escapes,
    so that none clears the screen, sets a title or forges a row or a line."""
    cli = Cli(pg_api)
    async with pg_api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "hostile"})).json()
    await worker_for(queue, registry, burst=True).run()
    await until(queue, job["id"], State.FAILED)
    outs = [
        await cli("jobs", "show", job["id"]),
        await cli("jobs", "logs", job["id"]),
        await cli("dead-letters", "list", key=ADMIN),
        await cli("dead-letters", "show", job["id"], key=ADMIN),
    ]
    for code, out, err in outs:
        assert code == 0, err
        assert not any(ch in out for ch in "\x1b\x00\x07\r\x9b"), repr(out)
        assert not any(line.startswith("FAKE ROW") for line in out.splitlines()), out
    assert "line1\\nFAKE ROW \\x1b[2J\\x1b[31m\\x1b]0;title\\x07\\x00\\r\\x9b" in outs[0][1]
    assert "line1\\nFAKE ROW" in outs[1][1]  # the log line
    shown = await cli.json("jobs", "show", job["id"])  # JSON: the text itself, escaped by JSON
    from tests.debug_tasks import HOSTILE

    assert shown["status"]["error"]["message"] == HOSTILE, shown


async def test_workers_lists_the_live_workers_and_their_jobs(
    pg_api: ApiServer, queue: Queue, background: Background
) -> None:
    cli = Cli(pg_api)
    code, out, _ = await cli("workers", key=ADMIN)
    assert code == 0 and out.startswith("no live worker"), out
    worker = worker_for(queue, registry, concurrency=3)
    background.start(worker)
    async with pg_api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "gated"})).json()
    await until(queue, job["id"], State.RUNNING)
    try:
        code, out, err = await cli("workers", "--jobs", key=ADMIN)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["WORKER", "HOST", "QUEUES", "TASKS", "RUNNING", "SEEN"]
        (row,) = [line.split() for line in lines if line.startswith(worker.id)]
        # queues, tasks (the first three of many), running/slots, seen
        first, *_ = sorted(registry.names())
        assert row[-6] == "default" and row[-5].startswith(first + ",") and row[-4] == "more"
        assert row[-5].endswith(f",+{len(registry.names()) - 3}") and row[-3] == "1/3", row
        assert [line for line in lines if line.startswith(job["id"])], out  # its job
        assert "jobs running: 1 (1 of 1 listed" in out, out
        listed = await cli.json("workers", key=ADMIN)
        (mine,) = [w for w in listed["workers"] if w["id"] == worker.id]
        assert mine["concurrency"] == 3 and [j["id"] for j in mine["jobs"]] == [job["id"]]
        code, _, err = await cli("workers", key=KEYS["acme"])  # the admin key's
        assert code == 1 and "HTTP 403" in err, err
    finally:
        gate(job["id"]).set()


async def test_queues_list_pause_resume_limit(pg_api: ApiServer, queue: Queue) -> None:
    cli = Cli(pg_api)
    async with pg_api.client() as c:
        await c.post("/v1/jobs", json={"type": "echo", "payload": 1})
    code, out, err = await cli("queues", admin_key=ADMIN)
    assert err == "", err
    header, *rows = out.splitlines()
    assert code == 0 and header.split()[:3] == ["QUEUE", "READY", "RUNNING"]
    (default,) = [r.split() for r in rows if r.split()[0] == "default"]
    assert default[1] == "1"  # one ready job
    code, _, err = await cli("queues", key=None)  # without an action: the list, so named
    assert code == 2 and err.startswith("jobtier queues list: no API key"), err
    code, out, _ = await cli("queues", "pause", "default", key=ADMIN)
    assert code == 0 and out.strip() == "default: paused"
    queues = {q["name"]: q for q in await cli.json("queues", key=ADMIN)}
    assert queues["default"]["paused"] is True
    limited = await cli.json(
        "queues", "limit", "default", "--concurrency", "3", "--rate", "10", "--per", "2",
        key=ADMIN,
    )  # fmt: skip
    assert limited["limits"] == {"concurrency": 3, "rate": 10, "per": 2.0}
    queues = {q["name"]: q for q in await cli.json("queues", "list", key=ADMIN)}
    assert queues["default"]["limits"] == {"concurrency": 3, "rate": 10, "per": 2.0}
    code, out, _ = await cli("queues", "list", key=ADMIN)
    assert "concurrency 3, 10/2s" in out
    code, out, _ = await cli("queues", "limit", "default", "--none", key=ADMIN)
    assert code == 0 and "no limits" in out
    code, _, err = await cli("queues", "limit", "default", key=ADMIN)
    assert code == 2 and "--concurrency" in err
    code, out, _ = await cli("queues", "resume", "default", key=ADMIN)
    assert code == 0 and out.strip() == "default: resumed"
    queues = {q["name"]: q for q in await cli.json("queues", key=ADMIN)}
    assert queues["default"]["paused"] is False and queues["default"]["limits"] is None
    code, _, err = await cli("queues", "pause", "no:colons", key=ADMIN)
    assert code == 1 and "queue name must match" in err
    # a name nothing has used: paused all the same (before its first job), but it may be a
    # typo of one, and the answer says so (it read as any other before)
    code, out, _ = await cli("queues", "pause", "defualt", key=ADMIN)
    assert code == 0 and out.startswith("defualt: paused (no job, limit or task had named")
    assert (await cli.json("queues", "pause", "defualt", key=ADMIN))["known"] is True

    # a block (a task's RateLimited) shows in the list; unblock says what it lifted
    until = await queue.admin.block("default", 600) / 1000
    code, out, _ = await cli("queues", key=ADMIN)
    header, *rows = out.splitlines()
    assert "BLOCKED" in header.split()
    (blocked,) = [r for r in rows if r.split()[0] == "default"]
    held = datetime.fromtimestamp(until, UTC).strftime("%Y-%m-%d %H:%M:%S")
    assert f"until {held}" in blocked, out
    code, out, _ = await cli("queues", "unblock", "default", key=ADMIN)
    assert code == 0 and out.strip() == f"default: unblocked (it was held until {held})", out
    code, out, _ = await cli("queues", "unblock", "default", key=ADMIN)
    assert code == 0 and out.strip() == "default: was not blocked (nothing changed)", out
    again = await cli.json("queues", "unblock", "default", key=ADMIN)
    assert again == {"queue": "default", "blocked": False, "blocked_until": None}

    # purge: asks for --yes, then cancels the ready job, and says how many
    code, _, err = await cli("queues", "purge", "default", key=ADMIN)
    assert code == 2 and "give --yes" in err, err
    assert (await queue.admin.stats())["queues"]["default"]["queued"]["normal"] == 1
    code, out, _ = await cli("queues", "purge", "default", "--yes", key=ADMIN)
    assert code == 0 and out.strip() == "default: purged, 1 job cancelled", out
    purged = await cli.json("queues", "purge", "default", "--yes", key=ADMIN)
    assert purged == {"queue": "default", "cancelled": 0, "remaining": 0}


async def test_the_async_client_does_the_same(
    pg_api: ApiServer, queue: Queue, persister: Persister
) -> None:
    async with pg_api.client() as c:
        ok = (await c.post("/v1/jobs", json={"type": "chatty", "payload": {"n": 1}})).json()
        bad = (await c.post("/v1/jobs", json={"type": "deep_failure"})).json()
    queue.produce.tasks = registry
    await worker_for(queue, registry, burst=True).run()
    await persister.drain()
    async with (
        AsyncClient(pg_api.url, KEYS["acme"]) as tenant,
        AsyncClient(pg_api.url, ADMIN) as admin,
    ):
        page = await tenant.list_jobs(state="failed")
        assert [j.id for j in page.jobs] == [bad["id"]] and page.next_cursor is None
        details = await tenant.show(ok["id"])
        assert details.result == "logged" and details.status.state is State.SUCCEEDED
        assert [line.message for line in details.lines] == ["line 0", "done"]
        assert details.history is not None and details.history[-1].to_state is State.SUCCEEDED
        assert [line.message for line in await tenant.logs(ok["id"])] == ["line 0", "done"]
        history = await tenant.history(bad["id"])
        assert history[-1].error is not None and history[-1].error.traceback
        with pytest.raises(WrongState):
            await tenant.retry(ok["id"])
        dead = await admin.dead_letters(since=datetime.now(UTC) - timedelta(hours=1))
        assert [j.id for j in dead] == [bad["id"]]
        letter = await admin.dead_letter(bad["id"])
        assert letter.job.error is not None and letter.job.error.type == "ValueError"
        assert await admin.replay_dead_letters(type="deep_failure") == [bad["id"]]
        await worker_for(queue, registry, burst=True).run()  # it fails again
        with pytest.raises(ValidationFailed) as refused:  # every one: asked for by name
            await admin.replay_dead_letters()
        assert refused.value.field == "all" and '"all": true' in str(refused.value)
        assert await admin.replay_dead_letters(all=True) == [bad["id"]]
        await worker_for(queue, registry, burst=True).run()  # it fails again
        assert (await admin.replay(bad["id"])).state is State.QUEUED
        await worker_for(queue, registry, burst=True).run()
        assert (await tenant.retry(bad["id"])).attempt == 0


async def test_audit_lists_the_admin_actions_newest_first(pg_api: ApiServer) -> None:
    cli = Cli(pg_api)
    code, out, err = await cli("audit", admin_key=ADMIN)
    assert code == 0 and out.strip() == "no admin action recorded", err
    for action in ("pause", "resume", "pause"):
        assert (await cli("queues", action, "mail", key=ADMIN))[0] == 0
    code, out, err = await cli("audit", admin_key=ADMIN)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["AT", "BY", "ACTION", "TARGET", "STATUS", "DETAIL"]
    rows = [line.split() for line in lines[1:4]]  # AT is a date and a time
    assert [r[3] for r in rows] == ["queue.pause", "queue.resume", "queue.pause"]
    assert {r[4] for r in rows} == {"mail"} and {r[5] for r in rows} == {"200"}
    assert rows[0][2].startswith("admin:") and lines[4].startswith("(you are admin:")
    only = await cli.json("audit", "--action", "queue.resume", key=ADMIN)
    assert [r["action"] for r in only["records"]] == ["queue.resume"]
    # a page at a time: the first page says how to ask for the next
    code, out, _ = await cli("audit", "--limit", "2", admin_key=ADMIN)
    cursor = out.splitlines()[-1].removeprefix("older: --cursor ")
    code, out, _ = await cli("audit", "--limit", "2", "--cursor", cursor, admin_key=ADMIN)
    assert code == 0 and len(out.splitlines()) == 3  # the header, the oldest, who you are
    code, _, err = await cli("audit", "--action", "queue.limit", admin_key=ADMIN)
    assert code == 2 and "invalid choice" in err and "queue.limits" in err
    code, _, err = await cli("audit", admin_key=None, key=KEYS["acme"])
    assert code == 1 and "HTTP 403" in err and err.startswith("jobtier audit: ")
