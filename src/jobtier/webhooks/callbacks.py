"""Jobs' own callbacks (``webhook_job_callbacks``): checked, written, forgotten.

A job's callback is written before its submit reaches Redis, so the dispatcher finds it for
the job's first transition (the submit's own); if the submit then makes no job of that id
(refused, or an idempotent repeat answered with another job), the callback is deleted again.
The API's submits (``api/jobs.py``, ``api/flows.py``) and the in-process ``Queue.submit``,
``submit_many`` and ``submit_flow`` share this: plain jobs by ``submit_with_callbacks``
here, flows by ``flows/submit.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from jobtier.core.errors import IdempotencyConflict, InvalidRequest, JobtierError
from jobtier.core.keys import Keys
from jobtier.core.model import CallbackSpec, Submitted
from jobtier.persist.db import UNAVAILABLE, Pool, query
from jobtier.store.redis import RedisClient
from jobtier.webhooks import marks
from jobtier.webhooks.dispatcher import ensure_group
from jobtier.webhooks.safety import AddressPolicy, Refused

if TYPE_CHECKING:
    from jobtier.engine.queue import Queue
    from jobtier.store.scripts import SubmitItem

EVENTS = ("terminal", "all")


class SecretMissing(JobtierError):
    """A callback was given and the tenant has no webhook signing secret (the API: 409)."""

    def __init__(self) -> None:
        super().__init__(
            "the tenant has no webhook signing secret yet: create it with "
            "POST /v1/webhook-secret (or create a subscription), then submit again"
        )


class CallbackStore:
    """The callbacks of jobs: ``register`` before their submit, ``forget`` the ids it did
    not create. Postgres errors pass through (the API answers them with 503)."""

    def __init__(self, pool: Pool, redis: RedisClient, keys: Keys, policy: AddressPolicy) -> None:
        self.pool = pool
        self.redis = redis
        self.keys = keys
        self.policy = policy
        self._group_ready = False

    async def check(self, url: Any, events: Any, field: str) -> None:
        """``InvalidRequest`` naming ``field`` + ``url``/``events`` unless both are acceptable
        (the URL by the address policy: ``webhooks/safety.py``)."""
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
        for _, cb, field in callbacks:
            await self.check(cb.url, cb.events, field)
        if await self.pool.fetchrow(query("secret_get"), tenant) is None:
            raise SecretMissing()
        await self.ensure_group()
        # marked before the rows (and so before the submit): the dispatcher reads the mark
        # after the submit's log entry and decodes it (webhooks/marks.py)
        await marks.mark(self.redis, self.keys, [tenant])
        await self.pool.execute(
            query("callbacks_insert"), [job_id for job_id, _, _ in callbacks],
            [tenant] * len(callbacks), [cb.url for _, cb, _ in callbacks],
            [cb.events for _, cb, _ in callbacks],
        )  # fmt: skip
        # and again once the rows are in: a dispatcher's clean-up may have removed the first
        # mark before they were (marks.unmark_idle says why this one cannot be)
        await marks.mark(self.redis, self.keys, [tenant])

    async def forget(self, job_ids: Sequence[str]) -> None:
        """Delete the callbacks of ``job_ids`` (jobs a submit did not create)."""
        if job_ids:
            await self.pool.execute(query("callbacks_delete"), list(job_ids))


class Registrar(Protocol):
    """What writes and deletes a submit's callbacks: a ``CallbackStore`` in process, the
    API's ``WebhookService`` (its refusals as problems)."""

    async def register(
        self, tenant: str, callbacks: Sequence[tuple[str, CallbackSpec, str]]
    ) -> None: ...

    async def forget(self, job_ids: Sequence[str]) -> None: ...


async def submit_with_callbacks(
    queue: Queue,
    items: Sequence[SubmitItem],
    callbacks: Sequence[CallbackSpec | None],
    store: Registrar,
    *,
    batch: bool,
) -> list[Submitted | IdempotencyConflict]:
    """``Queue.submit_many_prepared`` for jobs (``callbacks``: each one's own, or None) with
    their callbacks written first, under the ids the jobs will get, and deleted again for
    every id the submit did not create: all of them when it is refused, a duplicate's (an
    idempotent repeat answers with the first job, which keeps its own callback). A refused
    callback names its member (``jobs[i].callback.url`` in a ``batch``, else
    ``callback.url``); then, or for a tenant without a secret, nothing is written or
    submitted."""
    ours = [
        (item.job_id, cb, f"jobs[{i}].callback." if batch else "callback.")
        for i, (item, cb) in enumerate(zip(items, callbacks, strict=True))
        if cb is not None
    ]
    if not ours:
        return await queue.submit_many_prepared(items, batch=batch)
    await store.register(items[0].tenant, ours)
    ids = [job_id for job_id, _, _ in ours]
    try:
        outcomes = await queue.submit_many_prepared(items, batch=batch)
    except (IdempotencyConflict, InvalidRequest):  # refused before any job was made
        await store.forget(ids)
        raise
    # Any other error (Redis lost mid-submit) keeps them: the jobs may exist.
    made = {
        outcome.job_id for outcome in outcomes if isinstance(outcome, Submitted) and outcome.created
    }
    unused = [job_id for job_id in ids if job_id not in made]
    if unused:
        # the jobs are submitted: a Postgres that fails now must not make the submit look
        # failed, and an orphan callback names a job that never runs (harmless)
        with contextlib.suppress(*UNAVAILABLE):
            await store.forget(unused)
    return outcomes
