"""Jobs' own callbacks (``webhook_job_callbacks``): checked, written, forgotten.

``CallbackStore`` is the engine's ``Registrar`` (``engine/produce.py``): a job's callback is
written before its submit reaches Redis, so the dispatcher finds it for the job's first
transition, and deleted again if the submit makes no job of that id.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from jobtier.config import Settings
from jobtier.core.errors import ConfigError, InvalidRequest, JobtierError
from jobtier.core.keys import Keys
from jobtier.core.model import CallbackSpec
from jobtier.persist.db import UNAVAILABLE, Pool, create_pool, query
from jobtier.store.redis import RedisClient
from jobtier.streams.group import create_groups
from jobtier.webhooks import marks
from jobtier.webhooks.safety import AddressPolicy, Refused

log = logging.getLogger("jobtier.webhooks")
EVENTS = ("terminal", "all")


async def ensure_group(redis: RedisClient, keys: Keys, start: str = "0") -> None:
    """Create the dispatchers' group on every shard log if missing. The API calls it (with
    ``$``) before it accepts the first webhook, so that the logs keep the entries a
    dispatcher will need even before one first runs."""
    streams = [keys.log(s) for s in range(keys.shards)]
    await create_groups(redis, streams, keys.dispatch_group(), start)


class SecretMissing(JobtierError):
    """A callback was given and the tenant has no webhook signing secret (the API: 409)."""

    def __init__(self) -> None:
        super().__init__(
            "the tenant has no webhook signing secret yet: create it with "
            "POST /v1/webhook-secret (or create a subscription), then submit again"
        )


@dataclass(eq=False)
class CallbackStore:
    """The callbacks of jobs: ``register`` before their submit, ``forget`` the ids it did
    not create. Postgres errors pass through (the API answers them with 503). ``own_pool``:
    ``close`` closes the pool."""

    pool: Pool
    redis: RedisClient
    keys: Keys
    policy: AddressPolicy
    _: KW_ONLY
    own_pool: bool = False
    _group_ready: bool = field(default=False, init=False)

    @classmethod
    async def connect(cls, settings: Settings, redis: RedisClient, keys: Keys) -> CallbackStore:
        """A store on a pool of its own (``close`` closes it), for in-process producers:
        ``Queue.connect(settings, callbacks=await CallbackStore.connect(...))``."""
        if not settings.database_url:
            raise ConfigError(
                "jobs' callbacks are written to Postgres and JOBTIER_DATABASE_URL is empty: set "
                "it to the deployment's Postgres (the one its dispatcher reads)"
            )
        pool = await create_pool(settings.database_url, min_size=0, max_size=2)
        policy = AddressPolicy(settings.webhook_allowed_hosts)
        return cls(pool, redis, keys, policy, own_pool=True)

    async def close(self) -> None:
        if self.own_pool:
            await self.pool.close()

    async def check(self, url: Any, events: Any, field: str) -> None:
        """``InvalidRequest`` naming ``field`` + ``url``/``events`` unless both are acceptable
        (the URL by the address policy)."""
        if not isinstance(url, str):
            raise InvalidRequest("url must be a string", field=f"{field}url")
        if events not in EVENTS:
            raise InvalidRequest(
                f"events must be one of {', '.join(EVENTS)}", field=f"{field}events"
            )
        try:
            await self.policy.check_url(url)
        except Refused as exc:
            raise InvalidRequest(
                f"callback URL refused: {exc} (JOBTIER_WEBHOOK_ALLOWED_HOSTS lists exceptions)",
                field=f"{field}url",
            ) from None

    async def ensure_group(self) -> None:
        """The dispatchers' group exists before the first webhook is accepted: from then on
        the logs keep every entry until a dispatcher has read it."""
        if not self._group_ready:
            await ensure_group(self.redis, self.keys, start="$")
            self._group_ready = True

    async def register(
        self, tenant: str, callbacks: Sequence[tuple[str, CallbackSpec, str]]
    ) -> None:
        """Write (job id, callback, field prefix) triples before their submit. Every one is
        checked before any is written: one refused (``InvalidRequest`` naming its field) or
        a tenant without a secret (``SecretMissing``) writes none."""
        for _, cb, where in callbacks:
            await self.check(cb.url, cb.events, where)
        if await self.pool.fetchrow(query("secret_get"), tenant) is None:
            raise SecretMissing()
        await self.ensure_group()
        # marked before the rows (and so before the submit): the dispatcher reads the mark
        # after the submit's log entry and decodes it (webhooks/marks.py)
        await marks.mark(self.redis, self.keys, [tenant])
        ids = [job_id for job_id, _, _ in callbacks]
        urls = [cb.url for _, cb, _ in callbacks]
        events = [cb.events for _, cb, _ in callbacks]
        await self.pool.execute(query("callbacks_insert"), ids, [tenant] * len(ids), urls, events)
        # and again once the rows are in: a dispatcher's clean-up may have removed the first
        # mark meanwhile (marks.unmark_idle)
        await marks.mark(self.redis, self.keys, [tenant])

    async def forget(self, job_ids: Sequence[str]) -> None:
        """Delete the callbacks of ``job_ids`` (jobs a submit did not create); with Postgres
        away they are left (they name jobs that never run) and logged."""
        if not job_ids:
            return
        try:
            await self.pool.execute(query("callbacks_delete"), list(job_ids))
        except UNAVAILABLE as exc:
            log.warning("event=callbacks_left jobs=%d error=%r", len(job_ids), exc)
