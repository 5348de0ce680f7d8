"""Durable submit at the API: ``Jobtier-Replicas: N`` (or JOBTIER_SUBMIT_REPLICAS) makes a
submit answer only once its writes reached N replicas (``store/durable.py``).

The header is checked against the replicas the deployment has: the most any master has had
since this process started (a replica down for a while still counts: its absence is a 503
that passes, not a request that can never succeed). Asked for more, the request is a 400.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.exceptions import RedisError
from starlette.requests import Request

from jobtier.api.auth import raw_header
from jobtier.api.problems import Problem
from jobtier.config import Settings
from jobtier.store import durable
from jobtier.store.redis import RedisClient, info_of_primaries
from jobtier.store.scripts import Scripts

log = logging.getLogger("jobtier.api")

HEADER = "Jobtier-Replicas"
_HEADER = HEADER.lower().encode()
PATTERN = "^[0-9]{1,3}$"
RECOUNT_EVERY = 10.0  # seconds between counts of the replicas, asked for more than known


class ReplicaCount:
    """The most replicas any master of the deployment has had (``INFO replication``)."""

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        self.known = 0
        self._counted = -RECOUNT_EVERY

    async def count(self) -> int:
        self._counted = time.monotonic()
        try:
            nodes = await info_of_primaries(self.redis, "replication")
        except RedisError as exc:
            log.warning("event=replica_count_failed error=%r", exc)
            return self.known
        seen = max((int(node.get("connected_slaves", 0)) for node in nodes), default=0)
        self.known = max(self.known, seen)
        return self.known

    async def at_least(self, wanted: int) -> bool:
        """Whether the deployment has (had) ``wanted`` replicas; counted again when it seems
        not to, at most every RECOUNT_EVERY seconds."""
        if wanted > self.known and time.monotonic() - self._counted >= RECOUNT_EVERY:
            await self.count()
        return wanted <= self.known


# the OpenAPI document's: the header, and what the submit routes answer because of it
PARAMETER = {
    "name": HEADER,
    "in": "header",
    "description": (
        "durable submit: answer only once the submit's writes reached this many Redis "
        "replicas (0: do not wait); default JOBTIER_SUBMIT_REPLICAS"
    ),
    "schema": {"type": "string", "pattern": PATTERN},
}
REFUSED_400 = (
    f"a {HEADER} header that is not a whole number, or asks for more replicas than the "
    "deployment's masters have (field)"
)
UNCONFIRMED_503 = (
    f"a durable submit ({HEADER}, JOBTIER_SUBMIT_REPLICAS) its replicas did not confirm within "
    "JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS (type …:replicas-unconfirmed, replicas_confirmed of "
    "replicas_wanted): the submit may have been made, retry with the same idempotency key"
)


async def replicas_wanted(request: Request) -> int:
    """The replicas this submit must reach: its ``Jobtier-Replicas`` header, else
    JOBTIER_SUBMIT_REPLICAS. A malformed header, or more than the deployment has: 400."""
    settings: Settings = request.state.settings
    raw = raw_header(request, _HEADER)
    if raw is None:
        return settings.submit_replicas
    if not raw.isdigit() or len(raw) > 3:
        raise Problem(400, "bad-request", f"{HEADER} must be a whole number", field=HEADER)
    wanted = int(raw)
    counter: ReplicaCount = request.state.replicas
    if wanted and not await counter.at_least(wanted):
        detail = (
            f"{HEADER}: {wanted} asks for more replicas than this deployment's masters have "
            f"({counter.known})"
        )
        raise Problem(400, "bad-request", detail, field=HEADER)
    return wanted


@asynccontextmanager
async def replicated(request: Request) -> AsyncIterator[None]:
    """Around a submit: with replicas wanted, its writes are each followed by WAIT, and the
    submit answers 503 (Retry-After) unless every WAIT counted enough replicas."""
    wanted = await replicas_wanted(request)
    if not wanted:
        yield
        return
    settings: Settings = request.state.settings
    with durable.waiting(wanted, settings.submit_replicas_timeout_ms) as state:
        yield
        if not state.waits:
            # it wrote nothing (a repeat of a submit, answered from what the first made):
            # those writes may not have reached the replicas yet
            scripts: Scripts = request.state.queue.store.scripts
            await scripts.confirm(range(scripts.keys.shards))
    if state.short:
        raise unconfirmed(state, settings)


def unconfirmed(state: durable.Durable, settings: Settings) -> Problem:
    confirmed = state.confirmed or 0
    log.warning(
        "event=submit_unreplicated wanted=%d confirmed=%d timeout_ms=%d",
        state.wanted, confirmed, state.timeout_ms,
    )  # fmt: skip
    detail = (
        f"{confirmed} of {state.wanted} replicas confirmed the submit within "
        f"{state.timeout_ms} ms (JOBTIER_SUBMIT_REPLICAS / {HEADER}, "
        "JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS); the job may exist: retry with the same "
        "idempotency key to get it"
    )
    retry = str(max(1, -(-settings.submit_replicas_timeout_ms // 1000)))
    return Problem(
        503,
        "replicas-unconfirmed",
        detail,
        headers={"retry-after": retry},
        replicas_confirmed=confirmed,
        replicas_wanted=state.wanted,
    )
