"""Durable submit: a submit acknowledged only once its writes reached N replicas.

Redis replicates asynchronously: a master that acknowledged a write and died before sending
it on takes the write with it, and the replica promoted in its place never had it. ``WAIT N
timeout`` blocks until N replicas confirmed the offset of the *connection's own* last write,
so it is sent on the very connection that carried the submit, right after it (one pipeline
per node: ``Scripts.call``/``call_many`` do so while a ``Durable`` is current).

A route opens ``waiting(n, timeout_ms)`` around its submit; every write script run inside
sends its WAIT, and the fewest replicas any WAIT counted is kept: ``short`` tells the route
to answer 503 instead of acknowledging (the writes are on the master, not yet on enough
replicas: a retry with the same idempotency key returns the job).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from redis.exceptions import RedisError

MARKER = "durable"  # a key per shard (base + MARKER) written before each WAIT: see ``marker``


@dataclass(slots=True)
class Durable:
    """The replicas wanted, how long a WAIT may block, and the fewest any WAIT counted."""

    wanted: int
    timeout_ms: int
    confirmed: int | None = None  # None: no WAIT sent yet
    waits: int = 0

    def saw(self, count: int) -> None:
        self.waits += 1
        self.confirmed = count if self.confirmed is None else min(self.confirmed, count)

    @property
    def short(self) -> bool:
        """Some WAIT counted fewer replicas than wanted."""
        return self.confirmed is not None and self.confirmed < self.wanted


_current: ContextVar[Durable | None] = ContextVar("jobtier_durable", default=None)


def current() -> Durable | None:
    """The durability the running submit asks for, or None (the default: no WAIT)."""
    return _current.get()


@contextmanager
def waiting(wanted: int, timeout_ms: int) -> Iterator[Durable]:
    """Within it, every write script run by this task (and tasks it starts) is followed by
    WAIT ``wanted`` ``timeout_ms`` on its connection; the ``Durable`` yielded tells the
    result. ``wanted`` 0 yields one that never waits."""
    durable = Durable(wanted, timeout_ms)
    if wanted <= 0:
        yield durable
        return
    token = _current.set(durable)
    try:
        yield durable
    finally:
        _current.reset(token)


def marker(base: str) -> tuple[str, str, str]:
    """A write sent before WAIT on each connection: WAIT counts the offset of the connection's
    last *propagated* write, and a script that wrote nothing (an idempotent repeat of a
    submit whose first answer was a 503) would leave it at some older write, not at the
    job's. Written now, it is past every earlier write on that node, the job's included."""
    return ("SET", base + MARKER, "1")


class Unreplicated(RedisError):
    """Writes not confirmed by the replicas wanted in time (a background submitter, such as
    the outbox relay, fails its pass and retries it: Redis is, for it, not there yet)."""
