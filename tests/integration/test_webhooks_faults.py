"""Webhooks under attack and faults: refused addresses are never contacted (at subscribe time
and, after DNS, at delivery time, pinned to the checked address), a SIGKILLed dispatcher
loses nothing, and the persisters keep log entries the dispatchers have not read."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import httpx
import pytest

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings, env_name
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.webhooks.callbacks import ensure_group
from jobtier.webhooks.dispatcher import Dispatcher
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import wait_for
from tests.fixtures.receiver import StartReceiver, deliveries, run_jobs, secret_of

PUBLIC = "93.184.216.34"  # what the API's resolver answers below; nothing connects to it


async def api_with(
    start_api: StartApi, s: Settings, allowed: str, resolve: dict[str, str] | None = None
) -> ApiServer:
    ext = PostgresExtension(s)
    if resolve is not None:
        table = resolve

        async def resolver(host: str, port: int) -> list[str]:
            return [table[host]]

        ext.webhook_resolver = resolver
    return await start_api(ext, database_url=s.database_url, webhook_allowed_hosts=allowed)


async def test_refused_addresses_are_refused_at_subscribe_time(
    start_api: StartApi, hook_settings: Settings, start_receiver: StartReceiver
) -> None:
    inside = await start_receiver("127.0.0.2")  # loopback, but not on the allow-list
    api = await api_with(start_api, hook_settings, "127.0.0.1")
    refused = [
        inside.url,
        "http://169.254.169.254/latest/meta-data",  # cloud metadata (link-local)
        "http://[fd00:ec2::254]/",  # AWS's IPv6 metadata (unique local)
        "http://10.1.2.3/", "http://192.168.0.1/", "http://100.64.0.1/",  # private, shared
        "http://[::ffff:127.0.0.2]:80/", "http://0.0.0.0/", "http://[::1]/",
        "ftp://127.0.0.1/", "http://user:pw@127.0.0.1/",
    ]  # fmt: skip
    async with api.client() as c:
        await secret_of(c)
        for url in refused:
            r = await c.post("/v1/webhooks", json={"url": url})
            assert r.status_code == 422 and r.json()["field"] == "url", (url, r.text)
            r = await c.post("/v1/jobs", json={"type": "echo", "callback": {"url": url}})
            assert r.status_code == 422 and r.json()["field"] == "callback.url", (url, r.text)
        assert (await c.get("/v1/webhooks")).json()["webhooks"] == []
    assert inside.requests == []


async def test_a_host_dns_cannot_encode_is_a_422_naming_the_field(
    start_api: StartApi, hook_settings: Settings, queue: Queue, pg_pool: Pool
) -> None:
    """Found by the fuzzer (schemathesis seed 11) as two 500s: the system resolver raised
    UnicodeError for a label over 63 characters and for a character IDNA refuses."""
    api = await api_with(start_api, hook_settings, "")  # the system's resolver
    hosts = ["a" * 64 + ".example", "\x80x.example", "a..example"]
    async with api.client() as c:
        await secret_of(c)
        for host in hosts:
            url = f"http://{host}/hook"
            r = await c.post("/v1/webhooks", json={"url": url})
            assert r.status_code == 422 and r.json()["field"] == "url", (url, r.text)
            assert "not a valid DNS name" in r.json()["detail"]
            r = await c.post("/v1/jobs", json={"type": "echo", "callback": {"url": url}})
            assert r.status_code == 422 and r.json()["field"] == "callback.url", (url, r.text)
        # nothing written: no subscription, no job, no callback row
        assert (await c.get("/v1/webhooks")).json()["webhooks"] == []
    logs = [await queue.redis.xlen(queue.keys.log(shard)) for shard in range(queue.keys.shards)]
    assert logs == [0] * queue.keys.shards
    assert await pg_pool.fetchval("SELECT count(*) FROM webhook_job_callbacks") == 0


async def test_the_dispatcher_checks_again_after_resolving_and_never_contacts_a_refused_address(
    start_api: StartApi, hook_settings: Settings, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    inside = await start_receiver("127.0.0.2")
    # DNS rebinding: the name resolves to a public address when the API checks it, to the
    # internal receiver when the dispatcher delivers
    name_url = f"http://hooks.example:{inside.port}/hook"
    api = await api_with(start_api, hook_settings, "127.0.0.1,127.0.0.2", {"hooks.example": PUBLIC})
    async with api.client() as c:
        await secret_of(c)
        jobs = []
        for url in (inside.url, name_url):  # the API (allowing 127.0.0.2) accepts both
            r = await c.post("/v1/jobs", json={"type": "echo", "callback": {"url": url}})
            assert r.status_code == 202, r.text
            jobs.append(r.json()["id"])
        await run_jobs(queue)

        async def rebound(host: str, port: int) -> list[str]:
            return ["127.0.0.2"]

        d = start_dispatcher()  # its allow-list: 127.0.0.1 only
        d.policy.resolve = rebound

        async def all_failed() -> bool:
            found = [await deliveries(c, j) for j in jobs]
            return all(f and f[0]["state"] == "failed" for f in found)

        await wait_for(all_failed, timeout=60)
        for job_id in jobs:
            (record,) = await deliveries(c, job_id)
            assert record["attempts"] == 4
            for attempt in record["attempt_log"]:
                assert attempt["status"] is None
                assert "refused" in attempt["error"] and "127.0.0.2" in attempt["error"]
    assert inside.requests == []  # never contacted, by any attempt
    assert d.sender.resolver.pinned == []


async def test_a_delivery_connects_to_the_address_it_checked(
    start_api: StartApi, hook_settings: Settings, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver("127.0.0.1")
    api = await api_with(start_api, hook_settings, "127.0.0.1", {"hooks.example": PUBLIC})
    async with api.client() as c:
        await secret_of(c)
        url = f"http://hooks.example:{receiver.port}/hook"  # a name no DNS server knows
        job_id = (await c.post("/v1/jobs", json={
            "type": "echo", "callback": {"url": url},
        })).json()["id"]  # fmt: skip
        await run_jobs(queue)

        async def resolved(host: str, port: int) -> list[str]:
            assert host == "hooks.example"
            return ["127.0.0.1"]

        d = start_dispatcher()
        d.policy.resolve = resolved

        async def done() -> bool:
            found = await deliveries(c, job_id)
            return bool(found) and found[0]["state"] == "delivered"

        await wait_for(done)
    assert d.sender.resolver.pinned == ["127.0.0.1"]
    assert receiver.requests[0].headers["host"] == f"hooks.example:{receiver.port}"


# --- a dispatcher killed -----------------------------------------------------------------
def env_of(settings: Settings) -> dict[str, str]:
    """The environment a `jobtier` process needs to see ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if value != getattr(defaults, f.name):
            env[env_name(f)] = str(int(value) if isinstance(value, bool) else value)
    return env


@pytest.fixture
def spawn_dispatcher(hook_settings: Settings) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobtier.cli.main", "dispatcher", "--name", name],
            env=env_of(hook_settings.replace(webhook_retry_schedule="1,1,1,1")),
            stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def submit_with_callbacks(c: httpx.AsyncClient, url: str, n: int) -> list[str]:
    r = await c.post("/v1/jobs/batch", json={
        "jobs": [{"type": "echo", "payload": i, "callback": {"url": url}} for i in range(n)],
    })  # fmt: skip
    assert r.status_code == 200, r.text
    return [item["job"]["id"] for item in r.json()["results"]]


@pytest.mark.slow
async def test_a_sigkilled_dispatcher_loses_no_delivery(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    spawn_dispatcher: Callable[[str], subprocess.Popen[bytes]],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    receiver.default = [500]  # every delivery's first attempt fails: its retry waits
    async with hook_api.client() as c:
        await secret_of(c)
        first = await submit_with_callbacks(c, receiver.url, 20)
        await run_jobs(queue)
        killed = spawn_dispatcher("doomed")

        async def all_tried() -> bool:
            found = [await deliveries(c, j) for j in first]
            return all(f and f[0]["attempts"] >= 1 for f in found)

        await wait_for(all_tried, timeout=60)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        # transitions made while no dispatcher runs wait in the logs
        second = await submit_with_callbacks(c, receiver.url, 20)
        await run_jobs(queue)
        await asyncio.sleep(0)
        spawn_dispatcher("heir")

        async def all_delivered() -> bool:
            found = [await deliveries(c, j) for j in first + second]
            return all(f and f[0]["state"] == "delivered" for f in found)

        await wait_for(all_delivered, timeout=120)
        ids = {(await deliveries(c, j))[0]["id"] for j in first + second}
    assert len(ids) == 40 and ids <= set(receiver.ids())


async def test_the_persister_keeps_log_entries_until_the_dispatchers_have_read_them(
    queue: Queue, pool: Pool, hook_settings: Settings
) -> None:
    s = hook_settings.replace(prefix=queue.settings.prefix, shards=queue.settings.shards)
    await ensure_group(queue.redis, queue.keys)  # a dispatcher group that has read nothing
    for i in range(6):
        await queue.submit("echo", i)
    await run_jobs(queue)  # 18 transitions

    async def log_length() -> int:
        return sum([await queue.redis.xlen(queue.keys.log(x)) for x in range(s.shards)])

    entries = await log_length()  # (the claims' and completions' may hold several)
    persister = Persister(s, queue.redis, pool, "p1")
    assert await persister.drain() == 18  # acknowledged by the persisters, then trimmed...
    assert await log_length() == entries  # ...but nothing is gone: the dispatchers have not read it
    dispatcher = Dispatcher(s, queue.redis, pool, "d1")
    try:
        assert await dispatcher.drain() == 18
    finally:
        await dispatcher.sender.close()
    await persister.consumer.trim()
    assert await log_length() == 0
