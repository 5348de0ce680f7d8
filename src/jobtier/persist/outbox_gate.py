"""Whether the outbox relay may submit now: the API's global admission limits, for the relay.

The API refuses submits past ``JOBTIER_MAX_WAITING_TOTAL`` waiting jobs, or while Redis's
memory is past ``JOBTIER_REDIS_MEMORY_REFUSE_RATIO`` (api/admission.py, which persist may not
import). The relay holds back on the same two counts: its rows stay pending in the outbox,
where they cost Redis nothing, until the counts fall again. Per-tenant caps, rate limits and
shedding by priority are the API's alone: they answer a caller who can retry, and the rows
of one tenant must not hold back another's in the relay's single ordered stream.
"""

from __future__ import annotations

import logging
import time

from jobtier.config import Settings
from jobtier.engine.queue_admin import QueueAdmin
from jobtier.store.context import Store
from jobtier.store.memory import redis_memory

log = logging.getLogger("jobtier.persist.outbox")

REFRESH = 1.0  # seconds a reading is reused: as often as the API's admission refreshes
LOG_EVERY = 60.0  # seconds between warnings while the relay stays paused


class RelayGate:
    """``closed()``: why the relay must wait now (``waiting``, ``memory``), or None;
    ``admitted(n)``: jobs just submitted, counted until the next reading (as the API counts
    what it lets through, so a backlog relayed between readings cannot overshoot much)."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.admin = QueueAdmin(store)
        self._read_at = -REFRESH
        self._waiting = 0
        self._memory_ratio = 0.0
        self._warned: dict[str, float] = {}

    async def closed(self) -> str | None:
        now = time.monotonic()
        if now - self._read_at >= REFRESH:
            self._waiting = sum((await self.admin.waiting_by_tenant()).values())
            self._memory_ratio = (await redis_memory(self.store.redis)).ratio
            self._read_at = now
        s = self.settings
        if self._waiting >= s.max_waiting_total:
            reason, detail = "waiting", f"waiting={self._waiting} limit={s.max_waiting_total}"
        elif self._memory_ratio > s.redis_memory_refuse_ratio:
            reason = "memory"
            detail = (
                f"redis_memory_ratio={self._memory_ratio:.3f} "
                f"refuse_ratio={s.redis_memory_refuse_ratio}"
            )
        else:
            return None
        if now - self._warned.get(reason, -LOG_EVERY) >= LOG_EVERY:
            self._warned[reason] = now
            log.warning(
                "event=outbox_relay_paused reason=%s %s: the rows wait in the outbox",
                reason,
                detail,
            )
        return reason

    def admitted(self, n: int) -> None:
        self._waiting += n
