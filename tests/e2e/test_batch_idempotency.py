"""``idempotency_key`` on ``POST /v1/batches``: a repeat answers with the first batch and
makes nothing; the key with another request is a 409 naming the batch; a bad key a 422
naming the field."""

from __future__ import annotations

import asyncio

import pytest

from jobtier.client import AsyncClient, Client
from jobtier.engine.queue import Queue
from tests.e2e.test_load_shedding import waiting
from tests.fixtures.api import KEYS, ApiServer

pytestmark = pytest.mark.contract


async def test_a_repeated_key_answers_with_the_first_batch(api: ApiServer, queue: Queue) -> None:
    body = {"type": "echo", "items": [1, 2, 3], "idempotency_key": "import-7"}
    async with api.client() as c:
        first = await c.post("/v1/batches", json=body)
        assert first.status_code == 202, first.text
        again = await c.post("/v1/batches", json=body)
        assert again.status_code == 202, again.text
        assert again.json()["id"] == first.json()["id"]
        assert await waiting(queue) == 3
        other = await c.post("/v1/batches", json=body | {"items": [1, 2]})
        assert other.status_code == 409, other.text
        assert other.json()["batch_id"] == first.json()["id"]
        bad = await c.post("/v1/batches", json=body | {"idempotency_key": "has space"})
        assert bad.status_code == 422, bad.text
        assert "idempotency_key" in bad.text
        assert await waiting(queue) == 3


async def test_the_clients_pass_the_key(api: ApiServer) -> None:
    async with AsyncClient(api.url, KEYS["acme"]) as jobs:
        first = await jobs.submit_batch("echo", [1, 2], idempotency_key="k-async")
        again = await jobs.submit_batch("echo", [1, 2], idempotency_key="k-async")
        assert again.id == first.id
        assert (await jobs.submit_batch("echo", [1, 2])).id != first.id

    def blocking() -> None:
        with Client(api.url, KEYS["acme"]) as sync_jobs:
            one = sync_jobs.submit_batch("echo", [3], idempotency_key="k-sync")
            assert sync_jobs.submit_batch("echo", [3], idempotency_key="k-sync").id == one.id

    await asyncio.to_thread(blocking)
