"""Faults: a worker killed mid-job, Redis SIGKILLed under load. Nothing acknowledged is lost."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobtier.config import Settings
from jobtier.core.errors import Code
from jobtier.core.keys import Keys
from jobtier.core.model import JobSpec, State
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.scheduler import Scheduler
from jobtier.store import format as job_format
from jobtier.store.calls import complete_call
from jobtier.store.redis import connect
from jobtier.streams.group import lag
from tests.fixtures.api import StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.fixtures.postgres import assert_pg_matches_redis
from tests.fixtures.redis import as_jobtier
from tests.tasks import registry


def worker_process(settings: Settings, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        JOBTIER_REDIS_URL=settings.redis_url,
        JOBTIER_SHARDS=str(settings.shards),
        JOBTIER_LEASE_SECONDS=str(settings.lease_seconds),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "jobtier.cli.main", "worker", "tests.tasks:registry", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        # inherited: pytest captures its log with the test's (a pipe nobody reads would
        # block the worker once full, and leak)
    )


class RoleProcess:
    """A `jobtier <role>` process as deployed (the CLI), its log in a file; stopped
    (SIGTERM, then SIGKILL) at the end whatever happened."""

    def __init__(self, settings: Settings, logfile: Path, *command: str) -> None:
        env = {
            **os.environ,
            "JOBTIER_REDIS_URL": settings.redis_url,
            "JOBTIER_DATABASE_URL": settings.database_url,
            "JOBTIER_SHARDS": str(settings.shards),
            "JOBTIER_LEASE_SECONDS": str(settings.lease_seconds),
            "JOBTIER_LOG_LEVEL": "INFO",
        }
        self.logfile = logfile
        self.command = " ".join(command)
        with logfile.open("ab") as err:  # the child writes to its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jobtier.cli.main", *command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.logfile.read_text(errors="replace")

    def explain(self) -> str:
        return (
            f"jobtier {self.command}: exit code {self.proc.poll()}; its log:\n{self.log()[-6000:]}"
        )

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def test_killed_worker_jobs_are_reclaimed_and_its_late_writes_refused(
    settings: Settings, background: Background
) -> None:
    settings = settings.replace(lease_seconds=1.5)
    queue = await Queue.connect(settings, registry)
    try:
        subs = await queue.submit_many([JobSpec(type="slow_first") for _ in range(5)])
        ids = [s.job_id for s in subs]
        proc = worker_process(settings, "--concurrency", "10")
        try:

            async def all_running() -> bool:
                return all([(await queue.status(i)).state is State.RUNNING for i in ids])

            await wait_for(all_running, timeout=20)
            leases = {i: await queue.status(i) for i in ids}  # version == the lease_version
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        background.start(Scheduler(queue.store))
        background.start(worker_for(queue, registry))

        async def all_succeeded() -> bool:
            return all([(await queue.status(i)).state is State.SUCCEEDED for i in ids])

        await wait_for(all_succeeded, timeout=30)
        for i in ids:
            status, result = await queue.result(i)
            assert status.attempt == 2 and result == "done on attempt 2"
            assert status.worker != leases[i].worker
            # the killed worker wakes up and reports success with what it was given: refused
            old = leases[i]
            assert old.worker is not None
            (code,) = await queue.scripts.call(
                *complete_call(
                    queue.keys.shard_of(i), old.worker, 60, [(i, old.version, b'"stale"')]
                )
            )
            assert Code(code) is Code.WRONG_STATE
            assert (await queue.result(i))[1] == "done on attempt 2"
    finally:
        await background.stop()  # the worker and scheduler use the queue: they stop first
        await queue.close()


# --- Redis SIGKILLed under load ---------------------------------------------------------------
StartRole = Callable[..., RoleProcess]


@pytest.fixture
def roles(tmp_path: Path) -> Iterator[StartRole]:
    """Start `jobtier <role>` processes (settings, then the command's arguments), each
    logging to its own file in tmp_path; all stopped at the end whatever happened."""
    started: list[RoleProcess] = []

    def start(settings: Settings, *command: str) -> RoleProcess:
        logfile = tmp_path / f"{command[0]}-{len(started)}.log"
        started.append(RoleProcess(settings, logfile, *command))
        return started[-1]

    yield start
    for proc in started:
        proc.stop()


class Submitter:
    """Submits jobs over HTTP without pause (several requests always in flight) until
    stopped: every id the API acknowledged (202, or 200 for a submit the client library sent
    again across a kill), how many it turned away with 503 + Retry-After while Redis was
    gone, and any other answer (none is expected)."""

    def __init__(self, client: httpx.AsyncClient, concurrent: int = 4) -> None:
        self.client = client
        self.acknowledged: list[str] = []
        self.unavailable = 0
        self.unexpected: list[tuple[int, str]] = []
        self._running = True
        self._tasks = [asyncio.create_task(self._run(n)) for n in range(concurrent)]

    async def _run(self, n: int) -> None:
        i = 0
        while self._running:
            i += 1
            # every fifth job runs for a while: some are running whenever Redis is killed. A
            # task with retries: a claim that Redis made but whose reply the kill lost leases
            # its jobs to a worker that never hears of them, and those attempts end by lease
            # expiry (a task without retries would fail them, never having run them)
            seconds = 0.3 if i % 5 == 0 else 0.0
            body = {"type": "slow", "payload": {"seconds": seconds, "from": [n, i]}}
            r = await self.client.post("/v1/jobs", json=body)
            if r.status_code in (200, 202):
                # 200: a submit Redis took whose reply the kill lost, sent again by the
                # client library with the same id and answered as the job it made
                self.acknowledged.append(r.json()["id"])
            elif r.status_code == 503 and r.headers.get("retry-after"):
                self.unavailable += 1
                await asyncio.sleep(0.05)  # as a client told to come back soon would
            else:
                self.unexpected.append((r.status_code, r.text))

    async def stop(self) -> None:
        self._running = False
        await asyncio.gather(*self._tasks)


async def job_states(redis: Any, keys: Keys) -> dict[str, str]:
    """Every job hash in Redis and its state, read with plain commands (no script: a script
    the test loaded would hide a process that fails to load its own)."""
    names = [k async for k in redis.scan_iter(match=f"{keys.prefix}:{{*}}:job:*", count=1000)]
    names = [n for n in names if n.count(b":") == 3]  # jt:{s}:job:<id>, nothing under it
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    states = {}
    for name, raw in zip(names, await pipe.execute(), strict=True):
        if raw:
            states[name.decode().rsplit(":", 1)[1]] = job_format.job_fields(raw)["state"]
    return states


async def job_hash(redis: Any, keys: Keys, job_id: str) -> dict[str, str]:
    """A job's hash, its packed fields unpacked (plain commands, as ``job_states``)."""
    return job_format.job_fields(await redis.hgetall(keys.job(job_id)))


async def running_jobs(redis: Any, keys: Keys) -> int:
    return sum([await redis.zcard(keys.active(s)) for s in range(keys.shards)])


@pytest.mark.slow
async def test_acknowledged_jobs_survive_redis_sigkilled_under_load(
    redis_to_kill: LocalRedis,
    start_api: StartApi,
    pg_dsn: str,
    pg_pool: Pool,
    roles: StartRole,
    background: Background,
) -> None:
    """Redis SIGKILLed (no shutdown, no final AOF write) twice while a `jobtier worker`
    process runs jobs, a `jobtier persister` process writes behind, a scheduler reclaims
    and the API takes submits over HTTP, then started again from its AOF on the same port
    and data. Nobody helps them back: the test reloads no script and restarts no process.
    Every job the API acknowledged, before, during or after a kill, ends succeeded; every
    job Redis holds ends terminal, and Postgres holds each as Redis does; the API answers
    submits only with 202, 200 (a submit the client library sent again across the kill,
    answered as the job it made) or 503 + Retry-After; the processes are alive throughout
    and log no traceback.

    The Redis runs with ``appendfsync always`` (``redis_to_kill``): every write is in its AOF
    before its reply. Under ``everysec`` a SIGKILL may lose writes Redis acknowledged in its
    last second or two (a postponed AOF write), and "every acknowledged job" would not hold.
    Redis 7 keeps the function library in its AOF, so the restarted server still has it;
    its script cache (``read_status``, run by EVALSHA) is empty, and the API loads the script
    again itself."""
    settings = Settings.from_env(
        {},
        redis_url=redis_to_kill.url,
        database_url=pg_dsn,
        shards=4,
        lease_seconds=3.0,
        api_port=0,
    )
    keys = Keys(settings.prefix, settings.shards)
    api = await start_api(redis_url=redis_to_kill.url)
    plain = connect(settings)  # the test's reads: plain commands only
    worker = roles(settings, "worker", "tests.tasks:registry", "--concurrency", "20")
    persister = roles(settings, "persister", "--name", "p1")
    queue = await Queue.connect(settings, registry)  # the scheduler's

    def explain() -> str:
        return worker.explain() + "\n" + persister.explain()

    try:
        # every write in the AOF before its reply (see redis_to_kill)
        assert await plain.config_get("appendfsync") == {"appendfsync": "always"}
        background.start(Scheduler(queue.store))
        async with api.client() as client:
            load = Submitter(client)
            try:
                for _ in range(2):
                    done = len(await succeeded(plain, keys))
                    # under load: the worker finishing jobs, some running, submits flowing
                    await wait_for(lambda: _more_succeeded(plain, keys, done + 100), 60, 0.2)  # noqa: B023
                    await wait_for(lambda: _some_running(plain, keys), 30)
                    acknowledged = len(load.acknowledged)
                    redis_to_kill.stop(signal.SIGKILL)
                    await asyncio.to_thread(redis_to_kill.start)  # the API answers meanwhile
                    # the API takes submits again by itself, and the worker runs them
                    await wait_for(lambda: len(load.acknowledged) > acknowledged + 100, 60)  # noqa: B023
                    assert worker.alive() and persister.alive(), explain()
            finally:
                await load.stop()
            assert load.unexpected == []

            async def all_acknowledged_succeeded() -> bool:
                states = await job_states(plain, keys)
                return all(states.get(i) == "succeeded" for i in load.acknowledged)

            try:
                await wait_for(all_acknowledged_succeeded, 120, 0.2)
            except TimeoutError:
                states = await job_states(plain, keys)
                astray = [(i, states.get(i)) for i in load.acknowledged]
                astray = [(i, state) for i, state in astray if state != "succeeded"]
                found = [await plain.hgetall(keys.job(i)) for i, _ in astray[:5]]
                pytest.fail(
                    f"{len(astray)} acknowledged jobs not succeeded: {astray[:10]}; "
                    f"the first: {found}\n{explain()}"
                )
            # an attempt beyond the first only ever followed a lease expiry (a lost claim
            # reply, or a heartbeat that could not reach Redis in time), never a task error
            for i in load.acknowledged:
                job = await job_hash(plain, keys, i)
                if job["attempt"] != "1":
                    assert '"type":"LeaseExpired"' in job.get("error", ""), (i, job)
            # and every job Redis holds (a submit answered 503 may have made one) ends
            await wait_for(lambda: _all_terminal(plain, keys), 60, 0.2)
            # the API reads a job made after the last restart as Redis holds it
            last = load.acknowledged[-1]
            r = await client.get(f"/v1/jobs/{last}")
            assert r.status_code == 200 and r.json()["state"] == "succeeded"

        async def drained() -> bool:
            return (await lag(plain, keys))[0] == 0

        await wait_for(drained, 120, 0.2)
        assert worker.alive() and persister.alive(), explain()
        # Redis away is an expected condition: logged in a line, not a crash's traceback
        assert "Traceback" not in worker.log() + persister.log(), explain()
        await assert_pg_matches_redis(plain, pg_pool, keys, list(await job_states(plain, keys)))
    finally:
        await background.stop()  # the scheduler uses the queue: it stops first
        await queue.close()
        await plain.aclose()


async def succeeded(redis: Any, keys: Keys) -> list[str]:
    return [i for i, state in (await job_states(redis, keys)).items() if state == "succeeded"]


async def _more_succeeded(redis: Any, keys: Keys, n: int) -> bool:
    return len(await succeeded(redis, keys)) > n


async def _some_running(redis: Any, keys: Keys) -> bool:
    return await running_jobs(redis, keys) > 0


async def _all_terminal(redis: Any, keys: Keys) -> bool:
    return set((await job_states(redis, keys)).values()) <= {"succeeded", "failed", "cancelled"}


# --- a reply lost with the connection ---------------------------------------------------------
class ReplyDropper:
    """A TCP proxy in front of Redis that, once ``armed`` with a pattern, forwards the next
    command containing it and then closes the client's connection instead of passing the
    reply on: what a client sees of a Redis killed after it ran a command (its effect in
    the AOF under ``appendfsync always``) and before it answered. With ``refuse_on_drop``,
    every connection after the drop is closed at once until ``refusing`` is cleared: a
    failover longer than the client library's own resends."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.pattern: bytes | None = None
        self.dropped = 0
        self.refuse_on_drop = False
        self.refusing = False
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.refusing:
            client_w.close()
            return
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.redis_port)
        sent = asyncio.Event()  # the armed command went to Redis on this connection
        tasks = {
            asyncio.create_task(self._upstream(client_r, server_w, sent)),
            asyncio.create_task(self._downstream(server_r, client_w, sent)),
        }
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            server_w.close()
            client_w.close()

    async def _upstream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sent: asyncio.Event
    ) -> None:
        while data := await reader.read(65536):
            if self.pattern is not None and self.pattern in data:
                self.pattern = None
                sent.set()
            writer.write(data)
            await writer.drain()

    async def _downstream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sent: asyncio.Event
    ) -> None:
        while data := await reader.read(65536):
            if sent.is_set():  # the armed command's reply: the connection dies instead
                self.dropped += 1
                self.refusing = self.refuse_on_drop
                return
            writer.write(data)
            await writer.drain()


async def test_a_claim_whose_reply_is_lost_leases_no_job_that_nobody_runs(
    settings: Settings, redis_server: LocalRedis
) -> None:
    """Redis ran a claim and the connection died before its reply (a Redis SIGKILLed right
    after the claim reached its AOF, as the SIGKILL test above sees now and then): the
    worker must get the job it leased, or the job must stay
    queued for another claim; a job running for a worker that does not know it holds it
    costs an attempt (a task without retries fails by LeaseExpired, never having run)."""
    dropper = ReplyDropper(redis_server.port)
    url = as_jobtier(await dropper.start())
    queue = await Queue.connect(settings.replace(redis_url=url), registry)
    try:
        job = await queue.submit("echo", "once")  # echo: no retries
        shard = queue.keys.shard_of(job.job_id)
        dropper.pattern = b"_claim"  # the claim function's name (FCALL jt_<digest>_claim)
        batch = await queue.scripts.claim(shard, "w-test", 10, 30_000)
        assert dropper.dropped == 1  # the reply was lost, and the call still answered
        status = await queue.status(job.job_id)
        claimed = [j.id for j in batch.jobs]
        assert claimed == [job.job_id] or status.state is State.QUEUED, (claimed, status)
    finally:
        await queue.close()
        await dropper.stop()


async def test_a_worker_sends_a_claim_round_whose_replies_were_lost_again(
    settings: Settings, redis_server: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim's reply is lost and Redis stays away longer than the client library's own
    resends (a failover): the worker's claim loop sends the same round again when Redis is
    back, and gets the job the lost round leased, rather than leaving it leased to nobody
    until its lease expires (an attempt lost; a task without retries failed)."""
    caplog.set_level(logging.WARNING, logger="jobtier.worker")
    producer = await Queue.connect(
        settings.replace(redis_url=as_jobtier(redis_server.url)), catalog=False
    )
    dropper = ReplyDropper(redis_server.port)
    url = as_jobtier(await dropper.start())
    queue = await Queue.connect(settings.replace(redis_url=url, lease_seconds=60.0), registry)
    worker = worker_for(queue, registry)
    task: asyncio.Task[Any] | None = None
    try:
        job = await producer.submit("echo", "once")  # echo: no retries
        dropper.refuse_on_drop = True
        dropper.pattern = b"_claim"
        task = asyncio.create_task(worker.run())
        await wait_for(lambda: "event=claim_failed" in caplog.text)
        assert dropper.dropped == 1
        dropper.refusing = False  # Redis is back

        async def ended() -> bool:
            return (await producer.status(job.job_id)).terminal

        # no scheduler runs: a job leased to nobody would stay running (until reclaimed)
        await wait_for(ended, timeout=20)
        status = await producer.status(job.job_id)
        assert (status.state, status.attempt) == (State.SUCCEEDED, 1), status
    finally:
        worker.stop()
        if task is not None:
            await asyncio.wait_for(task, 30)
        await queue.close()
        await producer.close()
        await dropper.stop()
