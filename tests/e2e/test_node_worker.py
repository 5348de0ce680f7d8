"""The Node worker of examples/node-worker against the real API on loopback: it registers its
tasks, runs jobs end to end (results, progress, log lines, retries, dead letters, a cancel),
and a completion it sends after its lease went stale is refused (409) and changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from jobtier.scheduler import Scheduler
from jobtier.store.calls import reclaim_call
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for
from tests.tracing_helpers import ids, traced_in_memory

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "examples" / "node-worker" / "worker.mjs"
STALE = ROOT / "tests" / "node" / "stale_completion.mjs"
NODE = shutil.which("node") or shutil.which("nodejs")
KEY = "wk-node"
TERMINAL = {"succeeded", "failed", "cancelled"}

# no skip without Node: the set-up installs it (scripts/system-deps.sh), and the promise
# is that the Node worker runs in CI, which a skip would quietly drop


@contextlib.asynccontextmanager
async def node(*args: str, **env: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A node process, killed on every way out of the block that left it running."""
    assert NODE is not None, "no node found: scripts/system-deps.sh installs Debian's nodejs"
    proc = await asyncio.create_subprocess_exec(
        NODE, *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    async with asyncio.timeout(20):
        return (await proc.stdout.readline()).decode().strip()


async def submit(api: ApiServer, type: str, payload: Any) -> str:
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": type, "payload": payload})
        assert r.status_code == 202, r.text
        job_id: str = r.json()["id"]
        return job_id


async def docs(api: ApiServer, ids: list[str]) -> dict[str, dict[str, Any]]:
    async with api.client() as c:
        return {i: (await c.get(f"/v1/jobs/{i}")).json() for i in ids}


async def test_the_node_worker_runs_jobs_end_to_end(
    start_api: StartApi, background: Background
) -> None:
    api = await start_api(worker_keys=KEY, lease_seconds=3)  # a heartbeat a second
    background.start(Scheduler(api.server.lifespan.state["queue"].store))  # retries' promotes
    env = {"JOBTIER_URL": api.url, "WORKER_KEY": KEY, "WORKER_ID": "n1"}
    async with node(str(WORKER), **env, WORKER_CONCURRENCY="8") as proc:
        assert await line(proc) == "ready"  # its tasks are in the catalogue: submits pass
        adds = [await submit(api, "node.add", {"a": i, "b": 10}) for i in range(20)]
        steps = await submit(api, "node.steps", {"steps": 3, "ms": 5})
        retried = await submit(api, "node.fail", {})
        fatal = await submit(api, "node.fail", {"fatal": True})
        limited = await submit(api, "node.fail", {"limited": True})
        held = await submit(api, "node.steps", {"steps": 1000, "ms": 20})
        late = await submit(api, "node.slow", {"ms": 60_000})
        async with api.client() as c:
            # its own timeout, given at the submit, in place of the task's (0.2 s)
            r = await c.post(
                "/v1/jobs", json={"type": "node.slow", "payload": {"ms": 600}, "timeout": 30}
            )
            assert r.status_code == 202, r.text
            given_more = r.json()["id"]
            r = await c.post("/v1/jobs", json={"type": "node.add", "payload": {"a": 1}})
            assert r.status_code == 422 and r.json()["field"] == "payload.b"  # its schema

            async def running() -> bool:
                return bool((await c.get(f"/v1/jobs/{held}")).json()["state"] == "running")

            await wait_for(running, timeout=30)
            assert (await c.post(f"/v1/jobs/{held}/cancel")).status_code == 200
        ids = [*adds, steps, retried, fatal, limited, held, late, given_more]

        async def finished() -> bool:
            return all(d["state"] in TERMINAL for d in (await docs(api, ids)).values())

        await wait_for(finished, timeout=60)
        queue = api.server.lifespan.state["queue"]
        assert await queue.redis.hexists(queue.keys.workers(), "http:n1")  # live
        proc.send_signal(signal.SIGTERM)
        stats = json.loads(await line(proc))
        async with asyncio.timeout(20):
            assert await proc.wait() == 0
    # it left as it stopped: no longer listed as live
    assert not await queue.redis.hexists(queue.keys.workers(), "http:n1")
    got = await docs(api, ids)
    async with api.client() as c:
        for i, job_id in enumerate(adds):
            result = (await c.get(f"/v1/jobs/{job_id}/result")).json()["result"]
            assert result == {"sum": i + 10, "by": "node"}
        logs = (await c.get(f"/v1/jobs/{adds[3]}/logs")).json()["lines"]
        assert [x["message"] for x in logs] == ["adding 3 and 10"]
    assert got[steps]["state"] == "succeeded" and got[steps]["progress"] == {"done": 3, "of": 3}
    assert (got[retried]["state"], got[retried]["attempt"]) == ("failed", 2)
    assert got[retried]["error"]["message"] == "failed on purpose"
    assert "worker.mjs" in got[retried]["error"]["traceback"]  # the JavaScript stack
    assert (got[fatal]["state"], got[fatal]["attempt"]) == ("failed", 1)
    assert got[fatal]["error"]["type"] == "NonRetryable"
    # given back once (RateLimited), then run: its one attempt (of two) counted; its queue
    # was held back for the retryAfter (50 ms), on every shard
    assert (got[limited]["state"], got[limited]["attempt"]) == ("succeeded", 1)
    keys = queue.keys
    name = f"{got[limited]['queue']}:blocked"
    blocks = [await queue.redis.hget(keys.queue_counts(s), name) for s in range(keys.shards)]
    assert all(int(end or 0) > 0 for end in blocks), blocks
    assert got[held]["state"] == "cancelled"
    assert (got[late]["state"], got[late]["error"]["type"]) == ("failed", "TimeoutError")
    assert got[given_more]["state"] == "succeeded"  # 600 ms, three times its task's timeout
    assert stats == {
        "succeeded": 23, "failed": 4, "held": 1, "cancelled": 1, "lost": 0, "unsent": 0
    }  # fmt: skip


async def test_a_jobs_calls_from_node_join_the_trace_of_its_submit(start_api: StartApi) -> None:
    """The claim hands each job's traceparent; the library sends it with the job's own calls
    (its failure here), whose API spans were roots of traces of their own."""
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with traced_in_memory() as traced:
        api = await start_api(worker_keys=KEY)
        env = {"JOBTIER_URL": api.url, "WORKER_KEY": KEY, "WORKER_ID": "n-traced"}
        async with node(str(WORKER), **env) as proc:
            assert await line(proc) == "ready"
            async with api.client() as c:
                body = {"type": "node.fail", "payload": {"fatal": True}}
                made = await c.post("/v1/jobs", json=body, headers={"traceparent": parent})
                assert made.status_code == 202, made.text
                job_id = made.json()["id"]

                async def failed() -> bool:
                    return bool((await c.get(f"/v1/jobs/{job_id}")).json()["state"] == "failed")

                await wait_for(failed, timeout=30)
        (submit,) = traced.spans("POST /v1/jobs")
        calls = [
            s
            for s in traced.spans()
            if (s.attributes or {}).get("url.path") == f"/v1/worker/jobs/{job_id}/fail"
        ]
        assert calls, [s.name for s in traced.spans()]
        for call in calls:
            assert ids(call)[0] == ids(submit)[0], call  # the submit's trace
            assert call.parent is not None and call.parent.span_id == ids(submit)[1]


async def test_a_stale_completion_from_node_is_refused(start_api: StartApi) -> None:
    # a 1 s lease the script never extends: reclaim (the scheduler's script, run here)
    # requeues the job and another worker claims it before the script's late completion
    api = await start_api(worker_keys=KEY, lease_seconds=1)
    async with api.client() as w:
        w.headers["authorization"] = f"Bearer {KEY}"
        task = {"type": "node.slow", "max_attempts": 3}
        assert (await w.put("/v1/worker/tasks", json={"worker": "t", "tasks": [task]})).is_success
        job_id = await submit(api, "node.slow", {"n": 1})
        async with node(str(STALE), api.url, KEY, "node.slow") as proc:
            claimed = json.loads(await line(proc))
            assert claimed["id"] == job_id
            queue = api.server.lifespan.state["queue"]
            shard = queue.keys.shard_of(job_id)

            async def requeued() -> bool:
                await queue.scripts.call_many([reclaim_call(shard, 10, 60, 60)])
                return bool((await docs(api, [job_id]))[job_id]["state"] == "queued")

            await wait_for(requeued)
            body = {"worker": "python", "types": ["node.slow"]}
            (again,) = (await w.post("/v1/worker/claim", json=body)).json()["jobs"]
            before = (await docs(api, [job_id]))[job_id]
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            answer = json.loads(await line(proc))
            assert answer["refused"] is True and answer["job_id"] == job_id
            assert (await docs(api, [job_id]))[job_id] == before  # nothing changed
            assert before["state"] == "running" and before["attempt"] == 2
            lease = {"worker": "python", "lease_version": again["lease_version"], "result": 1}
            r = await w.post(f"/v1/worker/jobs/{job_id}/complete", json=lease)
            assert r.json()["state"] == "succeeded"
            async with asyncio.timeout(20):
                assert await proc.wait() == 0


BIG = ROOT / "tests" / "node" / "big_results.mjs"


async def test_results_that_do_not_fit_one_request_lose_no_job(start_api: StartApi) -> None:
    """Twelve results each under the API's result limit (20 KB here) but together over its
    request limit (100 KB), one over the result limit and one JSON cannot encode (a BigInt),
    all ending at once: each of the twelve succeeds at its first attempt, and the other two
    fail for good saying why. Before, the
    batch's 413 sent every job of it back to wait out its lease and run again (the too-large
    one too, with no word of why)."""
    api = await start_api(
        worker_keys=KEY, max_result_bytes=20_000, max_request_bytes=100_000, lease_seconds=30
    )
    async with node(str(BIG), api.url, KEY, "15000", "30000") as proc:
        assert await line(proc) == "ready"
        mids = [await submit(api, "node.mid", {"i": i}) for i in range(12)]
        big = await submit(api, "node.big", {})
        odd = await submit(api, "node.bigint", {})
        ids = [*mids, big, odd]

        async def states(wanted: set[str]) -> bool:
            return all(d["state"] in wanted for d in (await docs(api, ids)).values())

        await wait_for(lambda: states({"running"}))  # every one claimed: they end together
        assert proc.stdin is not None
        proc.stdin.write(b"release\n")
        await wait_for(lambda: states(TERMINAL), timeout=60)
        found = await docs(api, ids)
        assert [(found[m]["state"], found[m]["attempt"]) for m in mids] == [("succeeded", 1)] * 12
        assert (found[big]["state"], found[big]["attempt"]) == ("failed", 1), found[big]
        assert found[big]["error"]["type"] == "ResultTooLarge", found[big]
        assert "JOBTIER_MAX_RESULT_BYTES" in found[big]["error"]["message"], found[big]
        assert (found[odd]["state"], found[odd]["error"]["type"]) == ("failed", "ResultNotJSON")
        proc.stdin.write(b"stop\n")
        stats = json.loads(await line(proc))
        assert (stats["succeeded"], stats["failed"], stats["lost"]) == (12, 2, 0), stats


CUT = ROOT / "tests" / "node" / "cut_off.mjs"


class Cutter:
    """A TCP forwarder on loopback between the Node worker and the API, to cut them apart as
    a network does: ``down()`` drops every connection and refuses new ones until ``up()``;
    ``lose_next_result_reply()`` lets the next ``POST /v1/worker/complete`` reach the API,
    then drops its connection as the reply comes (the API has answered; the worker never
    hears it); ``gateway_error_next_result()`` answers the next one itself with a proxy's
    HTML 502 page, never sending it on (``status``: another; ``every``: each one until
    ``up()``)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.is_down = False
        self.armed = False
        self.swallowed = 0  # result replies lost
        self.refused = 0  # result requests refused while down
        self.gateway = False  # the next result request is answered by a proxy's page
        self.gateway_status = 502
        self.gateway_every = False  # every result request, until up()
        self.gateway_errors = 0
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> Cutter:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        self.down()

    def down(self) -> None:
        self.is_down = True
        for w in list(self.writers):
            w.close()

    def up(self) -> None:
        self.is_down = False
        self.gateway = self.gateway_every = False

    def lose_next_result_reply(self) -> None:
        self.armed = True

    def gateway_error_next_result(self, status: int = 502, every: bool = False) -> None:
        self.gateway, self.gateway_status, self.gateway_every = True, status, every

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_down:
            if (await reader.read(65536)).startswith(b"POST /v1/worker/complete "):
                self.refused += 1
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers |= {writer, up_writer}
        losing = False

        async def requests() -> None:
            nonlocal losing
            while data := await reader.read(65536):
                if self.gateway and data.startswith(b"POST /v1/worker/complete "):
                    self.gateway = self.gateway_every
                    self.gateway_errors += 1
                    status = b"%d Proxy Error" % self.gateway_status
                    page = b"<html><body>%s</body></html>" % status
                    writer.write(
                        b"HTTP/1.1 %s\r\ncontent-type: text/html\r\nconnection: close\r\n"
                        b"content-length: %d\r\n\r\n%s" % (status, len(page), page)
                    )
                    await writer.drain()
                    return
                if self.armed and data.startswith(b"POST /v1/worker/complete "):
                    self.armed, losing = False, True
                up_writer.write(data)
                await up_writer.drain()

        async def replies() -> None:
            while data := await up_reader.read(65536):
                if losing:  # the API answered: the worker never hears it
                    self.swallowed += 1
                    return
                writer.write(data)
                await writer.drain()

        try:
            tasks = [asyncio.create_task(requests()), asyncio.create_task(replies())]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                t.cancel()
        except OSError:
            pass
        finally:
            for w in (writer, up_writer):
                self.writers.discard(w)
                w.close()


@pytest.mark.parametrize("fault", ["api out of reach", "reply lost", "a proxy's 502 page"])
async def test_results_whose_sends_fail_are_sent_again(start_api: StartApi, fault: str) -> None:
    """Five jobs end together while the worker cannot reach the API (every connection
    dropped, new ones refused), while the reply to their results is lost after the API took
    them, or when a proxy answers their send with an HTML 502 page: the worker sends the
    results again, and every job succeeds at its first
    attempt, counted as such. Before, a failed send gave the results up: the jobs waited out
    their leases and ran again, or (their reply lost) were counted as not done."""
    api = await start_api(worker_keys=KEY, lease_seconds=30)
    port = int(api.url.rsplit(":", 1)[1])
    async with Cutter(port) as cut, node(str(CUT), cut.url, KEY) as proc:
        assert await line(proc) == "ready"
        ids = [await submit(api, "node.hold", {"i": i}) for i in range(5)]

        async def states(wanted: set[str]) -> bool:
            return all(d["state"] in wanted for d in (await docs(api, ids)).values())

        await wait_for(lambda: states({"running"}))  # every one claimed: they end together
        if fault == "api out of reach":
            cut.down()
        elif fault == "reply lost":
            cut.lose_next_result_reply()
        else:
            cut.gateway_error_next_result()
        assert proc.stdin is not None
        proc.stdin.write(b"release\n")
        await wait_for(  # a send failed
            lambda: cut.refused + cut.swallowed + cut.gateway_errors > 0, timeout=60
        )
        cut.up()
        await wait_for(lambda: states(TERMINAL), timeout=60)
        found = await docs(api, ids)
        assert [(found[i]["state"], found[i]["attempt"]) for i in ids] == [("succeeded", 1)] * 5
        assert cut.swallowed == (fault == "reply lost")
        proc.stdin.write(b"stop\n")
        async with asyncio.timeout(60):
            while (said := await line(proc)).startswith("log: "):
                pass
        stats = json.loads(said)
        assert (stats["succeeded"], stats["failed"], stats["lost"]) == (5, 0, 0), stats


@pytest.mark.parametrize("fault", ["a proxy's 400 page", "api out of reach past the lease"])
async def test_results_are_given_up_when_sending_them_again_cannot_help(
    start_api: StartApi, fault: str
) -> None:
    """A result whose send is refused as a request (a proxy's 400 page: not the API's, and
    not one that passes) is not sent again; one whose send fails until its job's lease would
    have lapsed (the API out of reach, a 3 s lease) is given up then. Either way the worker
    says so, counts it unsent, and the job runs again once its lease has lapsed: here the API
    comes back, the leases are reclaimed, and the worker runs the jobs again."""
    lease = 30 if fault == "a proxy's 400 page" else 3
    api = await start_api(worker_keys=KEY, lease_seconds=lease)
    port = int(api.url.rsplit(":", 1)[1])
    queue = api.server.lifespan.state["queue"]
    async with Cutter(port) as cut, node(str(CUT), cut.url, KEY) as proc:
        assert await line(proc) == "ready"
        ids = [await submit(api, "node.hold", {"i": i}) for i in range(5)]
        await wait_for(lambda: _all_in(api, ids, {"running"}))
        if fault == "a proxy's 400 page":
            cut.gateway_error_next_result(400, every=True)
        else:
            cut.down()
        assert proc.stdin is not None
        proc.stdin.write(b"release\n")
        given_up: list[str] = []
        async with asyncio.timeout(60):
            while len(given_up) < 5:
                said = await line(proc)
                if "outcome not sent" in said:
                    given_up.append(said)
        if fault == "a proxy's 400 page":
            # each batch sent once: a 400 is not sent again, however long the lease
            assert 1 <= cut.gateway_errors <= 5, cut.gateway_errors
        assert await _all_in(api, ids, {"running"})  # nothing reached the API
        cut.up()
        shards = {queue.keys.shard_of(i) for i in ids}

        async def run_again() -> bool:
            await queue.scripts.call_many([reclaim_call(s, 10, 60, 60) for s in shards])
            return await _all_in(api, ids, TERMINAL)

        if fault == "api out of reach past the lease":
            await wait_for(run_again, timeout=60)
            found = await docs(api, ids)
            assert [(found[i]["state"], found[i]["attempt"]) for i in ids] == [("succeeded", 2)] * 5
        proc.stdin.write(b"stop\n")
        async with asyncio.timeout(60):
            while (said := await line(proc)).startswith("log: "):
                pass
        stats = json.loads(said)
        succeeded = 5 if fault == "api out of reach past the lease" else 0
        assert (stats["unsent"], stats["succeeded"], stats["lost"]) == (5, succeeded, 0), stats


async def _all_in(api: ApiServer, ids: list[str], states: set[str]) -> bool:
    return all(d["state"] in states for d in (await docs(api, ids)).values())


async def test_rate_limited_refuses_a_retry_after_the_api_would_refuse() -> None:
    """``RateLimited``'s ``retryAfter`` is a number of seconds >= 0 or null, checked when it is
    made: a bad one would be refused by the API (a 422) and the job's outcome never sent (it
    would wait out its lease), or, as Infinity, sent as null (the task's backoff)."""
    client = (ROOT / "examples" / "node-worker" / "jobtier-worker.mjs").as_uri()
    check = (
        f"const {{ RateLimited }} = await import({json.dumps(client)});"
        " for (const after of [-1, '30', Infinity, NaN, 0, 2.5, null]) {"
        "   try { new RateLimited('x', after); console.log('ok'); }"
        "   catch (e) { console.log(e.name); } }"
        # the queue is held back only when asked, for a retryAfter
        " for (const [after, o] of [[30, {blockQueue: true}], [30, {}], [null, {}]])"
        "   console.log(new RateLimited('x', after, o).blockQueue);"
        " try { new RateLimited('x', null, {blockQueue: true}); console.log('ok'); }"
        " catch (e) { console.log(e.name); }"
    )
    async with node("--input-type=module", "-e", check) as proc:
        assert proc.stdout is not None
        async with asyncio.timeout(20):
            out = (await proc.stdout.read()).decode().split()
    assert out == ["RangeError"] * 4 + ["ok"] * 3 + ["true", "false", "false", "RangeError"]
