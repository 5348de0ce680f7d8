"""The task catalogue: the tasks every worker says it runs, with their policies and payload
schemas, so that producers that do not import the tasks (the HTTP API) apply them at submit.

Workers write one entry per task to the hash ``jt:tasks`` when they start and at every full
heartbeat (``publish``). The API reads it (``TaskCatalog``, refreshed in the background and
on a miss) to refuse unknown types (unless ``JOBTIER_REQUIRE_KNOWN_TYPES=0``) and payloads
that do not fit the task's schema, and to give jobs their task's queue, attempts and
compensation. During a deploy two versions of a task may advertise different policies: the
latest writer wins, and a worker's own policy still governs the retries it decides.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from jobtier.core.keys import Keys
from jobtier.core.model import TaskAd, TaskInfo
from jobtier.core.names import HTTP_WORKER_PREFIX
from jobtier.engine.payload_schema import Check, schema_check
from jobtier.runtime.loop import every
from jobtier.runtime.stopping import stop_task
from jobtier.store.redis import RedisClient

log = logging.getLogger("jobtier.engine.catalog")
REFRESH_EVERY = 5.0  # seconds between loads of the catalogue
MISS_REFRESH = 1.0  # least seconds between loads for a type it does not know
_ad_decoder = msgspec.json.Decoder(TaskAd)


async def publish(redis: RedisClient, keys: Keys, ads: list[TaskAd]) -> None:
    """Write a worker's task entries (one HSET for all of them)."""
    if ads:
        mapping = {ad.type: msgspec.json.encode(ad) for ad in ads}
        await redis.hset(keys.tasks(), mapping=mapping)  # type: ignore[arg-type]


class TaskCatalog:
    """The catalogue as the API reads it: refreshed every ``REFRESH_EVERY`` seconds, and at
    once (at most every ``MISS_REFRESH`` seconds) when a submit names a type it does not know.
    An entry counts while its last advert is at most ``ttl`` seconds old."""

    def __init__(self, redis: RedisClient, keys: Keys, *, ttl: float = 86400.0) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl = ttl
        self._ads: dict[str, TaskAd] = {}
        self._infos: dict[str, TaskInfo] = {}
        # type -> ((its schema, whether held to the subset), the check made of them)
        self._checks: dict[str, tuple[tuple[bytes, bool], Check | None]] = {}
        self._loaded_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def info(self, type: str) -> TaskInfo | None:
        ad = self._ads.get(type)
        if ad is None or time.time() - ad.seen_at > self.ttl:
            return None
        return self._infos.get(type)

    def names(self) -> list[str]:
        now = time.time()
        return sorted(t for t, ad in self._ads.items() if now - ad.seen_at <= self.ttl)

    def ads(self) -> list[TaskAd]:
        """Every live entry (the admin API, the OpenAPI document)."""
        now = time.time()
        return [ad for _, ad in sorted(self._ads.items()) if now - ad.seen_at <= self.ttl]

    async def ensure(self, types: set[str]) -> None:
        """Refresh now if a type is unknown and the last load is old enough."""
        if any(self.info(t) is None for t in types) and (
            time.monotonic() - self._loaded_at >= MISS_REFRESH
        ):
            await self.load()

    async def load(self) -> None:
        raw = await self.redis.hgetall(self.keys.tasks())
        ads: dict[str, TaskAd] = {}
        for name, value in raw.items():
            try:
                ad = _ad_decoder.decode(value)
            except msgspec.DecodeError:
                continue  # written by a newer jobtier: its own workers will still run it
            ads[name.decode() if isinstance(name, bytes) else name] = ad
        infos = {}
        for name, ad in ads.items():
            check = None
            if ad.payload_schema is not None:
                # an HTTP worker's is held to the subset its key's holder may use
                strict = ad.worker.startswith(HTTP_WORKER_PREFIX)
                made_of = (msgspec.json.encode(ad.payload_schema), strict)
                cached = self._checks.get(name)
                if cached is None or cached[0] != made_of:
                    check = schema_check(ad.payload_schema, strict)
                    cached = self._checks[name] = (made_of, check)
                check = cached[1]
            infos[name] = TaskInfo(ad.queue, ad.max_attempts, check, ad.on_failure, ad.encrypt)
        self._ads, self._infos = ads, infos
        self._loaded_at = time.monotonic()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="jobtier-catalog")

    async def stop(self) -> None:
        await stop_task(self._task, "task catalog refresh")

    async def _loop(self) -> None:
        await every(REFRESH_EVERY, self.load, event="catalog_refresh", log=log)
