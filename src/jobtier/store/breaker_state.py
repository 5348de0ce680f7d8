"""Circuit breakers in Redis: ``breaker.lua`` called for one breaker, and every breaker read
for the admin list. Each breaker lives in the shard its name hashes to (``Keys.home``), so
every worker of a deployment shares it, and one Lua call changes it atomically."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from jobtier.core.breaker import STATES, Breaker
from jobtier.store.context import Store

RUN, PROBE, WAIT = 1, 2, 0  # admit's verdicts


@dataclass(frozen=True, slots=True)
class Admission:
    """What ``admit`` said: run (``probe``: the id of a half-open probe), or wait
    ``wait_ms``."""

    verdict: int
    wait_ms: int
    state: str
    probe: str

    @property
    def runs(self) -> bool:
        return self.verdict != WAIT


@dataclass(frozen=True, slots=True)
class BreakerView:
    """One breaker as the admin list shows it. ``state`` is what a worker would find now: an
    open breaker whose period is over shows half_open (its next job is a probe)."""

    name: str
    state: str
    open_until: float | None  # s since the epoch
    manual: bool
    trips: int
    changed_at: float | None
    reason: str
    thresholds: dict[str, Any] | None
    types: tuple[str, ...] = ()  # the task types that recorded against it

    @property
    def value(self) -> int:
        """The metric's value: 0 closed, 1 open, 2 half_open."""
        return STATES.index(self.state)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "open_until": self.open_until,
            "manual": self.manual,
            "trips": self.trips,
            "changed_at": self.changed_at,
            "reason": self.reason,
            "thresholds": self.thresholds,
            "types": list(self.types),
        }


_CONF = ("failures", "window_ms", "ratio", "min_calls", "open_ms", "backoff", "max_open_ms")


def _thresholds(text: str) -> dict[str, Any] | None:
    parts = text.split(" ")
    if len(parts) != len(_CONF) + 1:
        return None
    out: dict[str, Any] = {}
    for name, raw in zip((*_CONF, "probes"), parts, strict=True):
        out[name] = (
            float(raw) if raw and name in ("ratio", "backoff") else int(raw) if raw else None
        )
    return out


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw or "")


def view(name: str, fields: dict[Any, Any], now: float | None = None) -> BreakerView:
    """A breaker's hash as the admin list shows it."""
    f = {_text(k): _text(v) for k, v in fields.items()}
    state = f.get("state") or "closed"
    until_ms = int(f.get("until") or 0)
    manual = f.get("manual") == "1"
    now = time.time() if now is None else now
    if state == "open" and not manual and until_ms / 1000 <= now:
        state = "half_open"
    changed = int(f.get("changed") or 0)
    return BreakerView(
        name=name,
        state=state,
        open_until=until_ms / 1000 if state == "open" and until_ms else None,
        manual=manual,
        trips=int(f.get("trips") or 0),
        changed_at=changed / 1000 if changed else None,
        reason=f.get("reason", ""),
        thresholds=_thresholds(f.get("conf", "")),
        types=tuple(f.get("types", "").split()),
    )


class BreakerStates:
    """The breakers of one deployment."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    def _key(self, name: str) -> str:
        return f"{self.keys.base(self.keys.home(name))}breaker:{name}"

    async def _call(self, op: str, name: str, *args: Any) -> Any:
        return await self.store.scripts.call("breaker", self.keys.home(name), (op, name, *args))

    async def admit(
        self, breaker: Breaker, worker: str, probe_lease_ms: int, type: str = ""
    ) -> Admission:
        """May a job (of task ``type``) of ``breaker`` start now (see breaker.lua admit)."""
        args = (*breaker.args(), worker, probe_lease_ms, type)
        reply = await self._call("admit", breaker.name, *args)
        return Admission(int(reply[0]), int(reply[1]), _text(reply[2]), _text(reply[3]))

    async def record(
        self, breaker: Breaker, outcome: str, probe: str, reason: str, type: str = ""
    ) -> tuple[str, bool]:
        """How a job (of task ``type``) called the downstream: ``f`` it failed, ``s`` it
        answered, ``n`` neither (a probe given back); returns the breaker's state after, and
        whether this record changed it (opened or closed it)."""
        args = (*breaker.args(), outcome, probe, reason[:200], type)
        reply = await self._call("record", breaker.name, *args)
        return _text(reply[0]), len(reply) > 2

    async def extend(self, name: str, probe: str, lease_ms: int) -> bool:
        """Keep ``probe`` of breaker ``name`` out for ``lease_ms`` more (its job still runs);
        False when it is no longer out."""
        return bool(await self._call("extend", name, probe, lease_ms))

    async def open(self, name: str, seconds: float | None, reason: str) -> BreakerView:
        """Open ``name`` by hand, for ``seconds`` (None: until it is closed by hand)."""
        await self._call("open", name, round(seconds * 1000) if seconds else 0, reason[:200])
        return await self.get(name)

    async def close(self, name: str, reason: str) -> BreakerView:
        await self._call("close", name, reason[:200])
        return await self.get(name)

    async def get(self, name: str) -> BreakerView:
        return view(name, await self.store.redis.hgetall(self._key(name)))

    async def all(self) -> list[BreakerView]:
        """Every breaker any worker or admin has used, by name."""
        keys = self.keys
        pipe = self.store.redis.pipeline(transaction=False)
        for shard in range(keys.shards):
            pipe.smembers(f"{keys.base(shard)}breakers")
        names = sorted({_text(n) for members in await pipe.execute() for n in members})
        if not names:
            return []
        pipe = self.store.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self._key(name))
        now = time.time()
        return [view(n, h, now) for n, h in zip(names, await pipe.execute(), strict=True)]
