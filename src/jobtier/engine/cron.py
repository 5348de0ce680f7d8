"""Firing recurring schedules: slot arithmetic, misfires, and the schedules' copy in Redis.

A schedule (``core/schedule.py``) creates a normal job at each of its slots. Definitions are
stored durably in Postgres and mirrored in Redis, in the shard of the schedule
(``jt:{s}:cron`` and ``jt:{s}:cron:<id>``), where the scheduler fires them with ``fire.lua``:
a firing advances the schedule only if its next-fire time is still the one the scheduler
read (compare-and-set), and a slot's job id is derived from (schedule, slot), so a firing
replayed after a crash creates nothing.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
from croniter import croniter

from jobtier.core.keys import Keys, ulid
from jobtier.core.model import DEFAULT_QUEUE
from jobtier.core.schedule import MAX_CATCH_UP, Schedule
from jobtier.store.scripts import Script, run_scripts


@dataclass(frozen=True, slots=True)
class Timing:
    """What the slot arithmetic needs of a schedule."""

    cron: str | None
    timezone: str
    interval_ms: int | None
    anchor_ms: int  # interval schedules fire at anchor + k * interval
    start_ms: int | None = None  # no slot before it
    end_ms: int | None = None  # no slot after it

    def next_after(self, after_ms: int) -> int | None:
        """The first slot strictly after ``after_ms`` (and not before the start), or None
        when it would be after the end."""
        if self.start_ms is not None:
            after_ms = max(after_ms, self.start_ms - 1)
        slot = self._next(after_ms)
        return None if self.end_ms is not None and slot > self.end_ms else slot

    def _next(self, after_ms: int) -> int:
        if self.interval_ms is not None:
            k = max(0, (after_ms - self.anchor_ms) // self.interval_ms + 1)
            return self.anchor_ms + k * self.interval_ms
        assert self.cron is not None
        zone = ZoneInfo(self.timezone)
        slots = croniter(self.cron, datetime.fromtimestamp(after_ms / 1000, zone))
        nxt: datetime = slots.get_next(datetime)
        while self._repeated(nxt, zone):
            nxt = slots.get_next(datetime)
        return round(nxt.timestamp() * 1000)

    def last_at_or_before(self, at_ms: int) -> int:
        """The latest slot at or before ``at_ms`` and the end (not before an interval's
        anchor). Asked only once a slot has come: a slot at or after the start."""
        if self.end_ms is not None:
            at_ms = min(at_ms, self.end_ms)
        if self.interval_ms is not None:
            k = max(0, (at_ms - self.anchor_ms) // self.interval_ms)
            return self.anchor_ms + k * self.interval_ms
        assert self.cron is not None
        zone = ZoneInfo(self.timezone)
        slots = croniter(self.cron, datetime.fromtimestamp((at_ms + 1) / 1000, zone))
        prev: datetime = slots.get_prev(datetime)
        while self._repeated(prev, zone):
            prev = slots.get_prev(datetime)
        return round(prev.timestamp() * 1000)

    def _repeated(self, slot: datetime, zone: ZoneInfo) -> bool:
        """Whether ``slot`` is the second coming of a wall-clock time the clocks went back
        over, in a cron that names its minutes and hours (no ``*`` starts either field): such
        a schedule fires once a day at that time, at its first coming, as cron does. One
        with ``*`` in either field fires by the clock's passing: at both."""
        assert self.cron is not None
        minute, hour = self.cron.split()[:2]
        if minute.startswith("*") or hour.startswith("*"):
            return False
        wall = datetime.fromtimestamp(slot.timestamp(), zone)  # fold=1: the second coming
        return wall.fold == 1 and wall.utcoffset() != wall.replace(fold=0).utcoffset()

    def slots(self, first_ms: int, until_ms: int, most: int) -> list[int]:
        """Slots from ``first_ms`` (a slot) up to ``until_ms`` and the end, at most ``most``."""
        out: list[int] = []
        slot: int | None = first_ms
        while slot is not None and slot <= until_ms and len(out) < most:
            out.append(slot)
            slot = self.next_after(slot)
        return out


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def slot_job_id(keys: Keys, schedule_id: str, slot_ms: int) -> str:
    """The id of the job a schedule creates for a slot: the same in every process, always."""
    entropy = hashlib.blake2b(f"{schedule_id}:{slot_ms}".encode(), digest_size=10).digest()
    return f"{ulid(slot_ms, entropy)}-{keys.shard_for('schedule', schedule_id)}"


def plan(
    timing: Timing, misfire: str, due_ms: int, now_ms: int, grace_ms: int
) -> tuple[list[int], int | None, int | None]:
    """What to do with a schedule whose next firing ``due_ms`` has come: (slots to fire, new
    next-fire time or None once past its end, slot to record as last fired or None)."""
    if now_ms - due_ms <= grace_ms:
        return [due_ms], timing.next_after(due_ms), due_ms
    resume = timing.next_after(now_ms)
    if misfire == "skip":
        # the missed ones are skipped; the latest, when on time itself, is not one of them
        latest = timing.last_at_or_before(now_ms)
        if now_ms - latest <= grace_ms:
            return [latest], resume, latest
        return [], resume, None
    if misfire == "fire_once":
        latest = max(due_ms, timing.last_at_or_before(now_ms))
        return [latest], resume, latest
    missed = timing.slots(due_ms, now_ms, MAX_CATCH_UP)  # fire_all
    return missed, resume, missed[-1] if missed else None


def new_schedule_id() -> str:
    return ulid()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def to_datetime(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)


class MirrorDef(msgspec.Struct, kw_only=True):
    """What the scheduler needs to fire a schedule, as kept in Redis (``def``)."""

    tenant: str
    type: str
    priority: str
    max_attempts: int
    cron: str | None
    timezone: str
    interval_ms: int | None
    anchor_ms: int
    misfire: str
    queue: str = DEFAULT_QUEUE
    start_ms: int | None = None  # (a copy written before schedules had dates has neither)
    end_ms: int | None = None

    def timing(self) -> Timing:
        return Timing(
            self.cron, self.timezone, self.interval_ms, self.anchor_ms, self.start_ms, self.end_ms
        )


_def_decoder = msgspec.json.Decoder(MirrorDef)
Times = tuple[int | None, int | None, bool]  # a copy's next slot, last fired (ms), paused
_PUT = Script("cron_put")


def mirror_def(schedule: Schedule, default_max_attempts: int) -> MirrorDef:
    """The copy's definition: an interval's slots counted from its start, else its creation."""
    start, end = _ms(schedule.start_at, up=True), _ms(schedule.end_at)
    return MirrorDef(
        tenant=schedule.tenant,
        type=schedule.type,
        priority=schedule.priority.value,
        max_attempts=schedule.max_attempts or default_max_attempts,
        cron=schedule.cron,
        timezone=schedule.timezone,
        interval_ms=None if schedule.interval is None else schedule.interval * 1000,
        anchor_ms=start if start is not None else round(schedule.created_at.timestamp() * 1000),
        misfire=schedule.misfire,
        queue=schedule.queue or DEFAULT_QUEUE,
        start_ms=start,
        end_ms=end,
    )


_MS = timedelta(milliseconds=1)


def _ms(at: datetime | None, up: bool = False) -> int | None:
    """``at`` in whole ms: down, or ``up`` (a start of 11:59:59.9996 is not before a slot at
    12:00, and an end of that time is before it)."""
    if at is None:
        return None
    return -((_EPOCH - at) // _MS) if up else (at - _EPOCH) // _MS


class CronMirror:
    """The schedules' copy in Redis, and their firing (for the API and the scheduler)."""

    def __init__(self, redis: Any, keys: Keys, scripts: Any) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts = scripts

    def shard(self, schedule_id: str) -> int:
        return self.keys.shard_for("schedule", schedule_id)

    async def put(
        self,
        schedule_id: str,
        definition: MirrorDef,
        payload: bytes,
        next_ms: int | None,
        paused: bool,
        rev: str = "",
        *,
        keep_next: bool = False,
    ) -> None:
        """Create or replace a schedule's mirror, and wake the schedulers for its next slot,
        in one step (store/lua/cron_put.lua). ``rev``: the Postgres row's revision it copies
        (the scheduler's reconcile writes a copy of another revision again). ``keep_next``:
        its next slot is left as Redis has it (a change that moves no slot: a firing
        meanwhile may have advanced it)."""
        s = self.shard(schedule_id)
        nxt = "keep" if keep_next else ("" if next_ms is None else str(next_ms))
        keys = (self.keys.cron_def(s, schedule_id), self.keys.cron(s))
        copy = (msgspec.json.encode(definition), payload, "1" if paused else "0", rev)
        args = (2, *keys, schedule_id, *copy, nxt, self.keys.wake(s))
        await run_scripts(self.redis, [(_PUT, args)])

    async def due(self, schedule_id: str, next_ms: int) -> None:
        """Put back in its shard's due set a copy missing from it (not one that is there)."""
        await self.redis.zadd(
            self.keys.cron(self.shard(schedule_id)), {schedule_id: next_ms}, nx=True
        )

    async def definition(self, schedule_id: str) -> MirrorDef | None:
        """The definition the copy fires by (None: no copy)."""
        raw = await self.redis.hget(self.keys.cron_def(self.shard(schedule_id), schedule_id), "def")
        return None if raw is None else _def_decoder.decode(raw)

    async def listed(self) -> set[str]:
        """The ids of the schedules the schedulers fire from (every shard's due set)."""
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.keys.shards):
            pipe.zrange(self.keys.cron(shard), 0, -1)
        return {i.decode() for ids in await pipe.execute() for i in ids}

    async def remove(self, schedule_id: str) -> None:
        s = self.shard(schedule_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(self.keys.cron(s), schedule_id)
        pipe.delete(self.keys.cron_def(s, schedule_id))
        await pipe.execute()

    async def times(self, schedule_ids: list[str]) -> dict[str, Times]:
        """{id: (next fire ms, last fired ms, paused)} of the schedules Redis holds."""
        return {i: times for i, (times, _) in (await self.copies(schedule_ids)).items()}

    async def copies(self, schedule_ids: list[str]) -> dict[str, tuple[Times, str]]:
        """{id: (its times as ``times`` gives them, the revision its copy records: '' for a
        copy written before revisions were)} of the schedules Redis holds, in one read."""
        pipe = self.redis.pipeline(transaction=False)
        for schedule_id in schedule_ids:
            key = self.keys.cron_def(self.shard(schedule_id), schedule_id)
            pipe.hmget(key, "next", "last", "paused", "rev")
        replies = await pipe.execute()
        return {
            schedule_id: (
                (int(nxt) if nxt else None, int(last) if last else None, paused == b"1"),
                (rev or b"").decode(),
            )
            for schedule_id, (nxt, last, paused, rev) in zip(schedule_ids, replies, strict=True)
            if paused is not None
        }

    async def fire_due(
        self, shard: int, now: int, grace_ms: int, limit: int = 100
    ) -> tuple[int, int]:
        """Fire the shard's due schedules; returns (jobs created, next due ms or -1)."""
        due = await self.redis.zrangebyscore(
            self.keys.cron(shard), "-inf", now, start=0, num=limit, withscores=True
        )
        created = 0
        if due:
            pipe = self.redis.pipeline(transaction=False)
            for schedule_id, _ in due:
                pipe.hmget(
                    self.keys.cron_def(shard, schedule_id.decode()), "def", "payload", "next"
                )
            calls = []
            for (raw_id, _), (raw_def, payload, nxt) in zip(due, await pipe.execute(), strict=True):
                if raw_def is None or not nxt:
                    continue  # deleted meanwhile
                schedule_id = raw_id.decode()
                d = _def_decoder.decode(raw_def)
                slots, new_next, last = plan(d.timing(), d.misfire, int(nxt), now, grace_ms)
                after = -1 if new_next is None else new_next  # -1: no slot left (its end)
                firing = (schedule_id, nxt.decode(), after, "" if last is None else last)
                job = (d.tenant, d.type, d.priority, payload, d.max_attempts, d.queue)
                args: list[Any] = [*firing, *job, len(slots)]
                for slot in slots:
                    args += [slot_job_id(self.keys, schedule_id, slot), slot]
                calls.append(("fire", shard, args))
            for reply in await self.scripts.call_many(calls) if calls else []:
                created += int(reply[1])
        first = await self.redis.zrange(self.keys.cron(shard), 0, 0, withscores=True)
        return created, int(first[0][1]) if first else -1
