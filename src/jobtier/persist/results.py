"""Results kept outside Redis (``JOBTIER_RESULT_STORE``).

A worker whose task returns more than ``JOBTIER_RESULT_STORE_THRESHOLD_BYTES`` writes the
result to the store, and only once it is committed reports the success, with a reference
instead of the bytes: a succeeded job's result is always readable. The reference travels as
the job's ``result`` field, ``@<ref>`` (JSON never starts with ``@``), through complete.lua
(which adds ``result_url`` to the status), the log and the persister; the API streams it
back from ``result_url``.

A reference names the attempt (the worker's fencing token) as well as the job: an attempt
whose lease was lost writes under its own reference, which Redis refuses with the rest of
its success, so it never replaces the result of the attempt that won.

``PostgresResultStore`` keeps results in ``result_blobs``, uncompressed so that they stream
in slices; retention deletes them with their jobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from jobtier.config import Settings
from jobtier.persist.db import Pool, create_pool, query

CHUNK = 256 * 1024


class ResultStore(Protocol):
    """Where large results go. ``put`` returns once the bytes are durable."""

    async def put(self, job_id: str, token: int, data: bytes) -> str: ...

    async def size(self, ref: str) -> int | None: ...

    def stream(self, ref: str) -> AsyncIterator[bytes]: ...

    async def close(self) -> None: ...


CLOSE_SECONDS = 5.0  # closing waits this long for the connections held by puts in flight


class PostgresResultStore:
    """Results in ``result_blobs``: ref ``pg:<job id>:<token>``."""

    def __init__(self, pool: Pool, *, own_pool: bool = False) -> None:
        self.pool = pool
        self._own = own_pool

    @classmethod
    async def connect(cls, database_url: str) -> PostgresResultStore:
        return cls(await create_pool(database_url, min_size=0, max_size=4), own_pool=True)

    async def close(self) -> None:
        if self._own:
            try:  # a connection held by a put to a silent server is not waited for long
                await asyncio.wait_for(self.pool.close(), CLOSE_SECONDS)
            except TimeoutError:
                self.pool.terminate()

    @staticmethod
    def _parse(ref: str) -> tuple[str, int]:
        kind, _, rest = ref.partition(":")
        job_id, _, token = rest.rpartition(":")
        if kind != "pg" or not job_id or not token.isdigit():
            raise ValueError(f"not a Postgres result reference: {ref[:80]!r}")
        return job_id, int(token)

    async def put(self, job_id: str, token: int, data: bytes) -> str:
        await self.pool.execute(query("result_blob_put"), job_id, token, data)
        return f"pg:{job_id}:{token}"

    async def size(self, ref: str) -> int | None:
        job_id, token = self._parse(ref)
        size = await self.pool.fetchval(query("result_blob_size"), job_id, token)
        return None if size is None else int(size)

    async def get(self, ref: str) -> bytes | None:
        job_id, token = self._parse(ref)
        data = await self.pool.fetchval(query("result_blob_get"), job_id, token)
        return None if data is None else bytes(data)

    async def stream(self, ref: str) -> AsyncIterator[bytes]:
        """The bytes in slices of ``CHUNK``: a large result is never held whole."""
        job_id, token = self._parse(ref)
        offset = 1
        while True:
            chunk = await self.pool.fetchval(
                query("result_blob_chunk"), job_id, token, offset, CHUNK
            )
            if not chunk:
                return
            yield bytes(chunk)
            if len(chunk) < CHUNK:
                return
            offset += CHUNK


async def open_store(settings: Settings, pool: Pool | None = None) -> PostgresResultStore | None:
    """The store ``settings`` name, or None; on ``pool`` when given (the caller closes it)."""
    if settings.result_store != "postgres":
        return None
    if pool is not None:
        return PostgresResultStore(pool)
    return await PostgresResultStore.connect(settings.database_url)


async def reader_for(ref: str, pool: Pool) -> PostgresResultStore:
    """A store that reads ``ref`` (its kind is in its prefix), whatever the settings say now:
    a result stored before the setting changed stays readable."""
    if ref.startswith("pg:"):
        return PostgresResultStore(pool)
    raise ValueError(f"unknown result store of reference {ref[:80]!r}")
