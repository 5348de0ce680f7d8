"""Payloads and results encrypted at rest (docs/encryption.md), against real Redis and
Postgres: ciphertext in the job hash, the transition log's Postgres rows and the result
store; plaintext for the worker and for the tenant through the API; "[encrypted]" for the
admin; key rotation; tampered and moved ciphertexts; a missing key."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.core.errors import ConfigError, Fatal, InvalidRequest
from jobtier.core.model import State, encode_json
from jobtier.core.sealing import SealError, is_sealed
from jobtier.engine.catalog import publish
from jobtier.engine.queue import Queue
from jobtier.flows.resolver import Resolver
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.store.calls import promote_call
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import worker_for
from tests.fixtures.postgres import redis_clock_passes

K1 = "k1:" + base64.b64encode(bytes(range(32))).decode()
K2 = "k2:" + base64.b64encode(bytes(range(50, 82))).decode()
SECRET = "TOP-SECRET-4111-1111"
RESULT_SECRET = "RESULT-SECRET-42"
VISIBLE = "PLAIN-VISIBLE-7"
THRESHOLD = 1000  # results over it go to the result store (Postgres)

SEEN: list[Any] = []  # the payloads the tasks below received, in order


def _echo(payload: Any) -> dict[str, Any]:
    SEEN.append(payload)
    return {"echo": payload, "note": RESULT_SECRET}


@task(encrypt=True, retries=0)
async def secret_echo(ctx: JobContext, payload: Any) -> dict[str, Any]:
    return _echo(payload)


@task(queue="vault", retries=0)  # encrypted by its queue (JOBTIER_ENCRYPTED_QUEUES)
async def vault_echo(ctx: JobContext, payload: Any) -> dict[str, Any]:
    return _echo(payload)


@task(retries=0)
async def plain_echo(ctx: JobContext, payload: Any) -> dict[str, Any]:
    return _echo(payload)


@task(encrypt=True, retries=0)
async def secret_big(ctx: JobContext, payload: Any) -> dict[str, Any]:
    return {"rows": [f"{RESULT_SECRET}-{i}" for i in range(100)]}


@task(retries=0)
async def undo(ctx: JobContext, payload: Any) -> None:
    SEEN.append(payload)


@task(encrypt=True, retries=0, on_failure=undo)
async def secret_fail(ctx: JobContext, payload: Any) -> None:
    raise Fatal("declined")


@task(queue="vault", retries=0)  # a compensation made by Lua, in an encrypted queue
async def vault_undo(ctx: JobContext, payload: Any) -> dict[str, Any]:
    SEEN.append(payload)
    return {"undone": RESULT_SECRET}


@task(encrypt=True, retries=0, on_failure=vault_undo)
async def secret_fail_vault(ctx: JobContext, payload: Any) -> None:
    raise Fatal("declined")


# retried soon: a worker without the key gives the job back for a later attempt
@task(queue="vault", retries=2, backoff_base=0.05, jitter=0.0)
async def vault_retried(ctx: JobContext, payload: Any) -> dict[str, Any]:
    return _echo(payload)


@task(encrypt=True, retries=1, backoff_base=0.05, jitter=0.0)
async def secret_resume(ctx: JobContext, payload: Any) -> Any:
    """Saves a checkpoint holding the secret, fails its first attempt; the retry returns the
    state it resumed from."""
    if ctx.attempt == 1:
        await ctx.checkpoint({"card": SECRET})
        raise RuntimeError("the downstream is out")
    return {"resumed": ctx.checkpoint.resumed, "state": ctx.checkpoint.state}


@task(retries=0)
async def collect(ctx: JobContext, payload: Any) -> dict[str, Any]:
    return {dep_id: dep.result for dep_id, dep in ctx.dependencies.items()}


registry = TaskRegistry(
    [
        secret_echo,
        vault_echo,
        plain_echo,
        secret_big,
        undo,
        secret_fail,
        vault_undo,
        secret_fail_vault,
        vault_retried,
        secret_resume,
        collect,
    ]
)
BIG = {"rows": [f"{RESULT_SECRET}-{i}" for i in range(100)]}


@pytest.fixture(autouse=True)
def _seen() -> None:
    SEEN.clear()


@pytest.fixture
def crypt_settings(pg_settings: Settings) -> Settings:
    return pg_settings.replace(
        encryption_keys=K1,
        encrypted_queues="vault",
        result_store="postgres",
        result_store_threshold_bytes=THRESHOLD,
    )


@pytest.fixture
async def crypt_queue(crypt_settings: Settings) -> AsyncIterator[Queue]:
    q = await Queue.connect(crypt_settings, registry)
    await publish(q.redis, q.keys, [t.ad("tests") for t in registry])  # as its workers would
    yield q
    await q.close()


@pytest.fixture
async def crypt_api(start_api: StartApi, crypt_settings: Settings, crypt_queue: Queue) -> ApiServer:
    s = crypt_settings
    return await start_api(
        PostgresExtension(s), database_url=s.database_url, encryption_keys=s.encryption_keys,
        encrypted_queues=s.encrypted_queues, result_store=s.result_store,
        result_store_threshold_bytes=s.result_store_threshold_bytes,
    )  # fmt: skip


async def _hash(q: Queue, job_id: str) -> dict[bytes, bytes]:
    return cast(dict[bytes, bytes], await q.redis.hgetall(q.keys.job(job_id)))


async def _pg_text(pool: Pool, job_id: str) -> str:
    """Every Postgres row of the job (its record, history, dependencies, stored result)."""
    rows = []
    for table, column in (
        ("jobs", "id"),
        ("job_transitions", "job_id"),
        ("job_results", "job_id"),
        ("job_dependencies", "job_id"),
    ):
        found = await pool.fetch(
            f"SELECT row_to_json(t)::text AS r FROM {table} t WHERE {column} = $1", job_id
        )
        rows += [r["r"] for r in found]
    for r in await pool.fetch("SELECT data FROM result_blobs WHERE job_id = $1", job_id):
        rows.append(bytes(r["data"]).decode())
    assert rows, f"Postgres has nothing of {job_id}"
    return "\n".join(rows)


async def test_encrypted_jobs_are_ciphertext_at_rest_and_plaintext_for_worker_and_tenant(
    crypt_api: ApiServer, crypt_queue: Queue, pg_pool: Pool, crypt_settings: Settings
) -> None:
    q = crypt_queue
    card = {"card": SECRET}
    async with crypt_api.client() as acme, crypt_api.client("admin") as admin:
        ids = {}
        for kind, payload in (
            ("secret_echo", card),
            ("vault_echo", card),
            ("plain_echo", {"card": VISIBLE}),
            ("secret_big", None),
        ):
            r = await acme.post("/v1/jobs", json={"type": kind, "payload": payload})
            assert r.status_code == 202, r.text
            ids[kind] = r.json()["id"]
        sealed = [ids["secret_echo"], ids["vault_echo"], ids["secret_big"]]

        # Redis: the payload is an envelope, the plaintext nowhere in the hash
        for job_id in sealed:
            fields = await _hash(q, job_id)
            assert is_sealed(fields[b"payload"])
            assert all(SECRET.encode() not in v for v in fields.values())
        assert (await _hash(q, ids["plain_echo"]))[b"payload"] == encode_json({"card": VISIBLE})

        stats = await worker_for(q, registry, burst=True).run()
        assert stats.succeeded == 4 and stats.failed == 0
        assert SEEN.count(card) == 2 and {"card": VISIBLE} in SEEN  # the plaintext, decrypted

        # results: sealed in Redis, and in the result store for the large one
        for job_id in sealed[:2]:
            held = (await _hash(q, job_id))[b"result"]
            assert is_sealed(held) and RESULT_SECRET.encode() not in held
        big_ref = (await _hash(q, ids["secret_big"]))[b"result"]
        assert big_ref.startswith(b"@pg:")
        blob = await pg_pool.fetchval(
            "SELECT data FROM result_blobs WHERE job_id = $1", ids["secret_big"]
        )
        assert is_sealed(bytes(blob)) and RESULT_SECRET.encode() not in bytes(blob)

        # the tenant reads plaintext: the result, its content, the large one from the store
        expected = {"echo": card, "note": RESULT_SECRET}
        for job_id in sealed[:2]:
            assert (await acme.get(f"/v1/jobs/{job_id}/result")).json()["result"] == expected
            assert (await acme.get(f"/v1/jobs/{job_id}/result/content")).json() == expected
        r = await acme.get(f"/v1/jobs/{ids['secret_big']}/result/content")
        assert r.status_code == 200 and r.json() == BIG
        assert (await q.result(ids["secret_echo"]))[1] == expected  # and the Python Queue

        # the admin sees "[encrypted]", for the encrypted jobs only
        for job_id in sealed:
            detail = (await admin.get(f"/v1/admin/jobs/{job_id}")).json()
            assert detail["payload"]["value"] == "[encrypted]"
            assert (await admin.get(f"/v1/admin/jobs/{job_id}/payload")).json() == "[encrypted]"
            assert (await admin.get(f"/v1/admin/jobs/{job_id}/result")).json() == "[encrypted]"
        detail = (await admin.get(f"/v1/admin/jobs/{sealed[0]}")).json()
        assert detail["result"]["value"] == "[encrypted]"
        plain = (await admin.get(f"/v1/admin/jobs/{ids['plain_echo']}")).json()
        assert plain["payload"]["value"] == {"card": VISIBLE}

        # Postgres: the persister copies what Redis logged, so ciphertext there too
        await Persister(crypt_settings, q.redis, pg_pool, "p1").drain()
        for job_id in sealed:
            text = await _pg_text(pg_pool, job_id)
            assert SECRET not in text and RESULT_SECRET not in text
            assert '"$enc"' in text  # the envelopes are there
        assert VISIBLE in await _pg_text(pg_pool, ids["plain_echo"])  # the check finds plaintext

        # once Redis forgets the jobs, Postgres serves them: plaintext to the tenant only
        for job_id in sealed:
            await q.redis.delete(q.keys.job(job_id))
        echo = ids["secret_echo"]
        assert (await acme.get(f"/v1/jobs/{echo}/result")).json()["result"] == expected
        assert (await acme.get(f"/v1/jobs/{echo}/result/content")).json() == expected
        assert (await acme.get(f"/v1/jobs/{ids['secret_big']}/result/content")).json() == BIG
        detail = (await admin.get(f"/v1/admin/jobs/{echo}")).json()
        assert detail["source"] == "postgres"
        assert detail["payload"]["value"] == "[encrypted]"
        assert detail["result"]["value"] == "[encrypted]"
        assert (await admin.get(f"/v1/admin/jobs/{echo}/payload")).json() == "[encrypted]"

        # another tenant gets nothing, as for any job
        async with crypt_api.client("globex") as globex:
            assert (await globex.get(f"/v1/jobs/{ids['vault_echo']}/result")).status_code == 404


async def test_a_tampered_or_moved_ciphertext_fails_authentication(
    crypt_api: ApiServer, crypt_queue: Queue
) -> None:
    q = crypt_queue
    a = (await q.submit("secret_echo", {"card": SECRET})).job_id
    b = (await q.submit("secret_echo", {"card": "other"}, tenant="acme")).job_id
    c = (await q.submit("secret_echo", {"card": "third"})).job_id
    envelope = json.loads((await _hash(q, a))[b"payload"])
    sealed = base64.b64decode(envelope["c"])
    envelope["c"] = base64.b64encode(sealed[:-1] + bytes([sealed[-1] ^ 1])).decode()
    await q.redis.hset(q.keys.job(a), "payload", json.dumps(envelope, separators=(",", ":")))
    # b's ciphertext, intact, copied into c: bound to b's id, it does not open as c's
    await q.redis.hset(q.keys.job(c), "payload", (await _hash(q, b))[b"payload"])

    stats = await worker_for(q, registry, burst=True).run()
    assert stats.succeeded == 1 and stats.failed == 2  # failed for good: no retry loop
    assert SEEN == [{"card": "other"}]
    for job_id in (a, c):
        status = await q.status(job_id)
        assert status.state is State.FAILED and status.attempt == 1
        assert status.error is not None and status.error.type == "DecryptionFailed"
        assert "fails authentication" in status.error.message
        assert status.error.traceback is None

    # a tampered result: the tenant gets a 500 problem naming why, never the bytes
    held = json.loads((await _hash(q, b))[b"result"])
    held["n"] = base64.b64encode(bytes(12)).decode()
    await q.redis.hset(q.keys.job(b), "result", json.dumps(held, separators=(",", ":")))
    async with crypt_api.client() as acme:
        r = await acme.get(f"/v1/jobs/{b}/result")
    assert r.status_code == 500
    problem = r.json()
    assert problem["type"] == "urn:jobtier:problem:encryption"
    assert "fails authentication" in problem["detail"] and problem["job_id"] == b
    with pytest.raises(SealError, match="fails authentication"):
        await q.result(b)


async def test_rotation_keeps_old_jobs_readable_and_a_missing_key_fails_the_job(
    crypt_settings: Settings, crypt_queue: Queue
) -> None:
    s = crypt_settings.replace(result_store="")
    old = crypt_queue
    before = (await old.submit("secret_echo", {"n": 1})).job_id
    rotated = await Queue.connect(s.replace(encryption_keys=f"{K2},{K1}"), registry)
    only_new = await Queue.connect(s.replace(encryption_keys=K2), registry)
    try:
        after = (await rotated.submit("secret_echo", {"n": 2})).job_id
        lost = (await old.submit("vault_echo", {"n": 3})).job_id  # sealed with k1

        def kid(fields: dict[bytes, bytes], part: bytes) -> str:
            return str(json.loads(fields[part])["kid"])

        assert kid(await _hash(old, before), b"payload") == "k1"
        assert kid(await _hash(old, after), b"payload") == "k2"

        # a worker on the rotated keyring opens both; their results are sealed with k2
        stats = await worker_for(rotated, registry, burst=True, queues=["default"]).run()
        assert stats.succeeded == 2
        assert sorted(p["n"] for p in SEEN) == [1, 2]
        for job_id in (before, after):
            assert kid(await _hash(old, job_id), b"result") == "k2"
        # the rotated keyring reads both; k1 alone cannot read what k2 sealed
        assert (await rotated.result(before))[1]["echo"] == {"n": 1}
        with pytest.raises(SealError, match="key id 'k2'"):
            await old.result(after)

        # a worker without k1: the job fails with why, once, and the worker goes on
        stats = await worker_for(only_new, registry, burst=True, queues=["vault"]).run()
        assert stats.failed == 1 and stats.claimed == 1
        status = await old.status(lost)
        assert status.state is State.FAILED and status.attempt == 1
        assert status.error is not None and status.error.type == "EncryptionKeyMissing"
        assert "key id 'k1'" in status.error.message and "holds k2" in status.error.message
        # given the key back, the job replayed from the dead letters runs (its id, so its
        # ciphertext's binding, unchanged)
        await old.jobs.replay(lost)
        stats = await worker_for(rotated, registry, burst=True, queues=["vault"]).run()
        assert stats.succeeded == 1 and SEEN[-1] == {"n": 3}
    finally:
        await rotated.close()
        await only_new.close()


async def test_flows_and_compensations_hand_plaintext_to_the_next_task(
    crypt_api: ApiServer, crypt_queue: Queue
) -> None:
    q = crypt_queue
    dep = (await q.submit("secret_echo", {"card": SECRET}, tenant="acme")).job_id
    dependent = (await q.submit("collect", None, depends_on=[dep], tenant="acme")).job_id
    failing = (await q.submit("secret_fail", {"card": SECRET})).job_id
    resolver = Resolver(q.store, name="test-resolver")
    for _ in range(10):
        stats = await worker_for(q, registry, burst=True).run()
        if not await resolver.drain() and not stats.claimed:
            break
    status, out = await q.result(dependent)
    assert status.state is State.SUCCEEDED, status.error
    assert out == {dep: {"echo": {"card": SECRET}, "note": RESULT_SECRET}}
    async with crypt_api.client() as acme:
        r = await acme.get(f"/v1/jobs/{dependent}/dependencies")
    (found,) = r.json()["dependencies"]
    assert found["result"] == {"echo": {"card": SECRET}, "note": RESULT_SECRET}

    # the compensation's payload holds the failed job's, sealed in Redis, opened for its task
    comp = await q.jobs.compensation_of(failing)
    assert comp is not None
    assert SECRET.encode() not in (await _hash(q, comp))[b"payload"]
    undo_payload = next(p for p in SEEN if isinstance(p, dict) and "job_id" in p)
    assert undo_payload["job_id"] == failing
    assert undo_payload["payload"] == {"card": SECRET}


async def test_encryption_is_refused_where_it_cannot_hold(
    settings: Settings, crypt_queue: Queue, crypt_api: ApiServer
) -> None:
    # a worker with an encrypt=True task and no keys does not start
    plain = await Queue.connect(settings, catalog=False)
    try:
        with pytest.raises(ConfigError, match="secret_echo encrypts"):
            worker_for(plain, registry)
        # nor does a producer without keys take such a job
        plain.produce.know(secret_echo)
        with pytest.raises(ConfigError, match="no JOBTIER_ENCRYPTION_KEYS"):
            await plain.submit("secret_echo", {"card": SECRET})
    finally:
        await plain.close()
    # a schedule keeps its payload to make every slot's job from: refused for encrypted tasks
    # (and queues), through the API with a 422 naming the field, nothing stored
    async with crypt_api.client() as acme:
        for body in (
            {"name": "s1", "type": "secret_echo", "payload": {"card": SECRET}, "interval": 60},
            {"name": "s2", "type": "plain_echo", "queue": "vault", "interval": 60},
        ):
            r = await acme.post("/v1/schedules", json=body)
            assert r.status_code == 422, r.text
            assert "schedules do not support" in r.text and r.json()["field"] == "type"
        assert (await acme.get("/v1/schedules")).json()["schedules"] == []
    with pytest.raises(InvalidRequest, match="schedules do not support") as info:
        await crypt_queue.produce.task_defaults("secret_echo", None, None, {"card": SECRET})
    assert info.value.field == "type"
    with pytest.raises(InvalidRequest, match="schedules do not support"):
        await crypt_queue.produce.task_defaults("plain_echo", "vault", None, None)


async def _run_flows(q: Queue) -> None:
    """Workers and the resolver until nothing is left to do (compensations included)."""
    resolver = Resolver(q.store, name="test-resolver")
    for _ in range(10):
        stats = await worker_for(q, registry, burst=True).run()
        if not await resolver.drain() and not stats.claimed:
            return
    raise AssertionError("the flow did not settle")


async def test_a_copied_envelope_in_a_submitted_payload_is_never_opened(
    crypt_queue: Queue,
) -> None:
    q = crypt_queue
    victim = (await q.submit("secret_echo", {"card": SECRET}, tenant="acme")).job_id
    envelope = json.loads((await _hash(q, victim))[b"payload"])
    # another tenant's payload in the shape of lib.lua's compensation payload, naming the
    # victim and holding its envelope: to the compensation task's type and to a plain one
    forged = {"job_id": victim, "type": "secret_echo", "payload": envelope, "error": None}
    for kind in ("undo", "plain_echo"):
        await q.submit(kind, forged, tenant="globex")
    # a real compensation in the same run: the failed job's payload opened for its task
    failing = (await q.submit("secret_fail", {"card": SECRET}, tenant="acme")).job_id
    await _run_flows(q)

    assert len(SEEN) == 4  # victim's, the two forged ones, the compensation's
    opened = [p for p in SEEN if isinstance(p, dict) and p.get("payload") == {"card": SECRET}]
    assert [p["job_id"] for p in opened] == [failing]  # the real compensation's only
    forged_seen = [p for p in SEEN if isinstance(p, dict) and p.get("job_id") == victim]
    assert len(forged_seen) == 2 and all(p["payload"] == envelope for p in forged_seen)
    assert all(SECRET not in json.dumps(p) for p in forged_seen)


async def test_lua_made_jobs_in_an_encrypted_queue_keep_their_results_sealed(
    crypt_queue: Queue,
) -> None:
    q = crypt_queue
    failing = (await q.submit("secret_fail_vault", {"card": SECRET})).job_id
    await _run_flows(q)
    comp = await q.jobs.compensation_of(failing)
    assert comp is not None
    (seen,) = SEEN
    assert seen["job_id"] == failing and seen["payload"] == {"card": SECRET}
    fields = await _hash(q, comp)
    assert not is_sealed(fields[b"payload"])  # Lua wrote it; only its inner part is sealed
    assert is_sealed(fields[b"result"]) and RESULT_SECRET.encode() not in fields[b"result"]
    status, result = await q.result(comp)
    assert status.state is State.SUCCEEDED and result == {"undone": RESULT_SECRET}


async def test_rotation_in_two_phases_and_a_missing_key_retried(
    crypt_settings: Settings, crypt_queue: Queue
) -> None:
    s = crypt_settings.replace(result_store="")
    old = crypt_queue  # k1 only: a process the rotation has not reached yet
    # phase 1, everywhere: k2 added as decrypt-only; k1 still seals
    phase1 = await Queue.connect(s.replace(decryption_keys=K2), registry)
    # phase 2: k2 promoted to the sealing key, k1 kept to open what it sealed
    phase2 = await Queue.connect(s.replace(encryption_keys=f"{K2},{K1}"), registry)
    try:
        assert phase1.store.keyring is not None and phase1.store.keyring.sealing_kid == "k1"
        early = (await phase1.submit("vault_retried", {"n": 1})).job_id
        late = (await phase2.submit("vault_retried", {"n": 2})).job_id
        assert json.loads((await _hash(old, early))[b"payload"])["kid"] == "k1"
        assert json.loads((await _hash(old, late))[b"payload"])["kid"] == "k2"

        # a worker not yet deployed with k2 (the mistake two phases avoid): the job it cannot
        # open is retried with the task's back-off, not dead-lettered
        stats = await worker_for(old, registry, burst=True, queues=["vault"]).run()
        assert stats.claimed == 2 and SEEN == [{"n": 1}]
        status = await old.status(late)
        assert status.state is State.SCHEDULED and status.attempt == 1
        assert status.error is not None and status.error.type == "EncryptionKeyMissing"
        assert "key id 'k2'" in status.error.message

        # once due, a phase-1 worker (k2 decrypt-only) opens it; its result sealed with k1
        await redis_clock_passes(old.redis, 100)
        shards = range(old.keys.shards)
        await old.scripts.call_many([promote_call(shard, 100) for shard in shards])
        stats = await worker_for(phase1, registry, burst=True, queues=["vault"]).run()
        assert stats.succeeded == 1 and SEEN[-1] == {"n": 2}
        status = await old.status(late)
        assert status.state is State.SUCCEEDED and status.attempt == 2
        assert json.loads((await _hash(old, late))[b"result"])["kid"] == "k1"
        assert (await phase2.result(late))[1]["echo"] == {"n": 2}
    finally:
        await phase1.close()
        await phase2.close()


async def test_an_api_without_keys_answers_503_naming_them_and_writes_nothing(
    start_api: StartApi, crypt_settings: Settings, crypt_queue: Queue
) -> None:
    q = crypt_queue
    done = (await q.submit("secret_echo", {"card": SECRET}, tenant="acme")).job_id
    big = (await q.submit("secret_big", None, tenant="acme")).job_id
    stats = await worker_for(q, registry, burst=True).run()
    assert stats.succeeded == 2
    s = crypt_settings
    keyless = await start_api(
        PostgresExtension(s), database_url=s.database_url, result_store=s.result_store,
        result_store_threshold_bytes=s.result_store_threshold_bytes,
    )  # fmt: skip

    async def job_keys() -> list[bytes]:
        return [k async for k in q.redis.scan_iter(match=f"{s.prefix}*job:*")]

    before = sorted(await job_keys())
    async with keyless.client() as acme:
        r = await acme.post("/v1/jobs", json={"type": "secret_echo", "payload": {"card": 1}})
        assert r.status_code == 503, r.text
        problem = r.json()
        assert problem["type"] == "urn:jobtier:problem:encryption-keys-missing"
        assert "JOBTIER_ENCRYPTION_KEYS" in problem["detail"]
        assert sorted(await job_keys()) == before  # nothing written

        # the tenant's results: the same problem from Redis, and from the result store
        # (not "[encrypted]", the admin's mask)
        for url in (f"/v1/jobs/{done}/result", f"/v1/jobs/{done}/result/content",
                    f"/v1/jobs/{big}/result/content"):  # fmt: skip
            r = await acme.get(url)
            assert r.status_code == 503, (url, r.text)
            problem = r.json()
            assert problem["type"] == "urn:jobtier:problem:encryption-keys-missing"
            assert "no JOBTIER_ENCRYPTION_KEYS" in problem["detail"]
            assert RESULT_SECRET not in r.text
    async with keyless.client("admin") as admin:
        assert (await admin.get(f"/v1/admin/jobs/{big}/result")).json() == "[encrypted]"


async def test_a_plain_payload_marked_as_an_envelope_is_refused_unless_it_is_sealed(
    crypt_api: ApiServer, crypt_queue: Queue
) -> None:
    q = crypt_queue
    marked = {"$enc": "v1", "kid": "k1", "n": "AAAA", "c": "AAAA"}
    async with crypt_api.client() as acme:
        r = await acme.post("/v1/jobs", json={"type": "plain_echo", "payload": marked})
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "payload" and '"$enc": "v1"' in r.json()["detail"]
        # another member first: a plain payload like any other
        reordered = {"note": 1, **marked}
        r = await acme.post("/v1/jobs", json={"type": "plain_echo", "payload": reordered})
        assert r.status_code == 202, r.text
        # an encrypted task's payload is sealed whatever it is: it arrives as it was sent
        r = await acme.post("/v1/jobs", json={"type": "secret_echo", "payload": marked})
        assert r.status_code == 202, r.text
    stats = await worker_for(q, registry, burst=True).run()
    assert stats.succeeded == 2 and stats.failed == 0  # the refused one never ran
    assert sorted(SEEN, key=len) == [marked, reordered]


async def test_an_encrypted_job_s_checkpoint_is_sealed_at_rest_and_opened_for_it(
    crypt_api: ApiServer, crypt_queue: Queue, pg_pool: Pool, crypt_settings: Settings
) -> None:
    q = crypt_queue
    async with crypt_api.client() as acme:
        r = await acme.post("/v1/jobs", json={"type": "secret_resume", "payload": None})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        await worker_for(q, registry, burst=True).run()
        status = await q.status(job_id)
        assert status.state is State.SCHEDULED and status.attempt == 1
        # Redis: the job hash and the shard's log stream hold the envelope, not the state
        held = (await _hash(q, job_id))[b"cp"]
        assert is_sealed(held) and SECRET.encode() not in held
        shard = q.keys.shard_of(job_id)
        log = cast(list[tuple[bytes, dict[bytes, bytes]]], await q.redis.xrange(q.keys.log(shard)))
        assert log and all(SECRET.encode() not in v for _, e in log for v in e.values())
        # its tenant reads the state opened
        r = await acme.get(f"/v1/jobs/{job_id}/checkpoint")
        assert r.status_code == 200 and r.json()["state"] == {"card": SECRET}, r.text

        # the retry resumes from the state, opened for the task
        await redis_clock_passes(q.redis, 100)
        await q.scripts.call_many([promote_call(s, 100) for s in range(q.keys.shards)])
        await worker_for(q, registry, burst=True).run()
        assert (await q.result(job_id))[1] == {"resumed": True, "state": {"card": SECRET}}

        # Postgres: job_checkpoints (and every other row of the job) hold ciphertext only
        await Persister(crypt_settings, q.redis, pg_pool, "p1").drain()
        rows = await pg_pool.fetch(
            "SELECT state::text AS s FROM job_checkpoints WHERE job_id = $1", job_id
        )
        assert rows and all('"$enc"' in r["s"] and SECRET not in r["s"] for r in rows)
        assert SECRET not in await _pg_text(pg_pool, job_id)
        # once Redis forgets the job, the route opens the state Postgres keeps
        await q.redis.delete(q.keys.job(job_id))
        r = await acme.get(f"/v1/jobs/{job_id}/checkpoint")
        assert r.status_code == 200 and r.json()["state"] == {"card": SECRET}, r.text
