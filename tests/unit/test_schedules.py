"""Slot arithmetic, misfire planning and validation of recurring schedules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import Keys
from jobtier.core.schedule import ScheduleSpec, validate
from jobtier.engine.cron import Timing, plan, slot_job_id

MIN = 60_000
T0 = 1_800_000_000_000 - 1_800_000_000_000 % (5 * MIN)  # a multiple of five minutes


def ms(text: str, tz: str) -> int:
    return round(datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz)).timestamp() * 1000)


def test_cron_slots_in_a_time_zone_across_dst() -> None:
    t = Timing("30 2 * * *", "Europe/Paris", None, 0)
    first = t.next_after(ms("2026-03-28T00:00:00", "Europe/Paris"))
    assert first == ms("2026-03-28T02:30:00", "Europe/Paris")
    # 02:30 does not exist on the night clocks go forward: fired at 03:00 instead
    assert t.next_after(first) == ms("2026-03-29T03:00:00", "Europe/Paris")


def test_a_daily_time_the_clocks_go_back_over_fires_once() -> None:
    """01:30 comes twice in New York on 2026-11-01 (EDT, then EST): a daily 01:30 fires at
    the first only; an hourly one fires at each hour that passes, both 01:00s included."""
    daily = Timing("30 1 * * *", "America/New_York", None, 0)
    first = daily.next_after(ms("2026-10-31T12:00:00", "America/New_York"))
    assert first == ms("2026-11-01T01:30:00", "America/New_York")  # EDT, 05:30 UTC
    assert daily.next_after(first) == ms("2026-11-02T01:30:00", "America/New_York")
    # an hour later (06:45 UTC: the second 01:45) the latest slot is still the first 01:30
    assert daily.last_at_or_before(first + 75 * MIN) == first
    hourly = Timing("0 * * * *", "America/New_York", None, 0)
    one = first - 30 * MIN  # 01:00 EDT; then 01:00 EST, 02:00 EST, 03:00 EST
    assert hourly.slots(one, one + 3 * 60 * MIN, 10) == [one + k * 60 * MIN for k in range(4)]


@given(st.integers(1, 86_400), st.integers(0, 10**12), st.integers(0, 10**12))
def test_interval_slots_are_anchored_and_strictly_after(
    seconds: int, anchor: int, after: int
) -> None:
    t = Timing(None, "UTC", seconds * 1000, anchor)
    nxt = t.next_after(after)
    assert nxt is not None and nxt > after and (nxt - anchor) % (seconds * 1000) == 0
    assert nxt - seconds * 1000 <= max(after, anchor - 1) or nxt == anchor
    assert t.last_at_or_before(nxt) == nxt


@given(
    st.integers(1, 86_400),
    st.integers(0, 10**12),
    st.integers(0, 10**12),
    st.integers(1, 10**6),
)
def test_dated_interval_slots_start_at_the_start_and_stop_at_the_end(
    seconds: int, start: int, after: int, span: int
) -> None:
    """An interval's slots are counted from its start; none comes before it or after its end,
    and the first after any moment is the least slot after it within those dates."""
    step = seconds * 1000
    end = start + span
    t = Timing(None, "UTC", step, start, start, end)
    nxt = t.next_after(after)
    slots = [start + k * step for k in range(span // step + 1)]
    assert nxt == min((slot for slot in slots if slot > after), default=None)
    assert t.slots(start, 10**13, 2000) == slots


def test_a_dated_cron_fires_from_its_start_to_its_end() -> None:
    t = Timing("0 9 * * *", "Europe/Paris", None, 0, ms("2026-06-10T12:00:00", "Europe/Paris"))
    t = Timing(t.cron, t.timezone, None, 0, t.start_ms, ms("2026-06-13T09:00:00", "Europe/Paris"))
    first = t.next_after(ms("2026-01-01T00:00:00", "UTC"))
    assert first == ms("2026-06-11T09:00:00", "Europe/Paris")  # not the 10th's: before start
    assert t.slots(first, 10**13, 100) == [
        ms(f"2026-06-{day}T09:00:00", "Europe/Paris") for day in (11, 12, 13)
    ]  # the end itself is a slot
    assert t.next_after(ms("2026-06-13T09:00:00", "Europe/Paris")) is None


@pytest.mark.parametrize(
    ("policy", "fired"),
    [
        ("skip", []),  # the latest slot (the end) was missed too
        ("fire_once", [T0 + 20 * MIN]),  # the latest slot up to the end, not now's
        ("fire_all", [T0 + k * 5 * MIN for k in range(5)]),
    ],
)
def test_slots_missed_past_the_end_fire_up_to_it_and_leave_no_next(
    policy: str, fired: list[int]
) -> None:
    t = Timing("*/5 * * * *", "UTC", None, 0, None, T0 + 20 * MIN)
    slots, nxt, last = plan(t, policy, T0, T0 + 50 * MIN + 7, 60_000)
    assert slots == fired and nxt is None
    assert last == (fired[-1] if fired else None)
    on_time = plan(t, policy, T0 + 20 * MIN, T0 + 20 * MIN + 900, 60_000)
    assert on_time == ([T0 + 20 * MIN], None, T0 + 20 * MIN)  # the last slot


def test_on_time_firing_fires_the_slot() -> None:
    t = Timing("*/5 * * * *", "UTC", None, 0)
    assert plan(t, "skip", T0, T0 + 1500, 60_000) == ([T0], T0 + 5 * MIN, T0)


@pytest.mark.parametrize(
    ("policy", "fired"),
    [
        ("skip", [T0 + 50 * MIN]),  # only the ones before it were missed
        ("fire_once", [T0 + 50 * MIN]),
        ("fire_all", [T0 + k * 5 * MIN for k in range(11)]),
    ],
)
def test_missed_slots_follow_the_policy(policy: str, fired: list[int]) -> None:
    t = Timing("*/5 * * * *", "UTC", None, 0)
    now = T0 + 50 * MIN + 7
    slots, nxt, last = plan(t, policy, T0, now, 60_000)
    assert slots == fired and nxt == T0 + 55 * MIN
    assert last == (fired[-1] if fired else None)


def test_skip_fires_nothing_when_the_latest_slot_was_missed_too() -> None:
    t = Timing("*/5 * * * *", "UTC", None, 0)
    now = T0 + 52 * MIN  # the latest slot, T0 + 50 min, is two minutes late: past the grace
    assert plan(t, "skip", T0, now, 60_000) == ([], T0 + 55 * MIN, None)


def test_slot_job_ids_are_deterministic_and_sharded_with_the_schedule() -> None:
    keys = Keys("jt", 16)
    a, b = slot_job_id(keys, "S1", T0), slot_job_id(keys, "S1", T0)
    assert a == b and keys.valid_id(a)
    assert slot_job_id(keys, "S1", T0 + 1) != a and slot_job_id(keys, "S2", T0) != a
    assert keys.shard_of(a) == keys.shard_for("schedule", "S1")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "* * * * * *"}, "cron"),  # six fields
        ({"cron": "every minute"}, "cron"),
        ({"cron": None, "interval": None}, "cron"),
        ({"cron": "* * * * *", "interval": 60}, "cron"),
        ({"cron": None, "interval": 0}, "interval"),
        ({"timezone": "Mars/Olympus"}, "timezone"),
        # a folder of zones, and a name too long for a file (were OSErrors: a 503)
        ({"timezone": "America"}, "timezone"),
        ({"timezone": "Asia/" + "x" * 300}, "timezone"),
        ({"name": "has space"}, "name"),
        ({"type": "bad type"}, "type"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"payload": {"x": object()}}, "payload"),
        ({"start_at": datetime(2030, 1, 1)}, "start_at"),  # no time zone
        ({"end_at": datetime(2030, 1, 1)}, "end_at"),
        ({"end_at": datetime(1970, 1, 1, tzinfo=UTC)}, "end_at"),
        ({"start_at": datetime(9999, 12, 31, tzinfo=UTC)}, "start_at"),
        (
            {
                "start_at": datetime(2030, 1, 2, tzinfo=UTC),
                "end_at": datetime(2030, 1, 1, tzinfo=UTC),
            },
            "end_at",
        ),
        (
            {
                "start_at": datetime(2030, 1, 1, tzinfo=UTC),
                "end_at": datetime(2030, 1, 1, tzinfo=UTC),
            },
            "end_at",
        ),
    ],
)
def test_bad_schedules_are_refused(changes: dict[str, object], field: str) -> None:
    values: dict[str, object] = {"name": "nightly", "type": "echo", "cron": "0 3 * * *", **changes}
    with pytest.raises(InvalidRequest) as info:
        validate(ScheduleSpec(**values), min_interval=1, max_payload=1000)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.parametrize(
    ("cron", "message"),
    [
        ("*/61 * * * *", "cron minute field '*/61': step 61 is out of range 1-59"),
        ("*/0 * * * *", "cron minute field '*/0': step 0 is out of range 1-59"),
        ("0-59/60 * * * *", "cron minute field '0-59/60': step 60 is out of range 1-59"),
        ("0 24 * * *", "cron hour field '24': 24 is out of range 0-23"),
        ("0 */24 * * *", "cron hour field '*/24': step 24 is out of range 1-23"),
        ("0 0 0 * *", "cron day-of-month field '0': 0 is out of range 1-31"),
        ("0 0 1-32 * *", "cron day-of-month field '1-32': 32 is out of range 1-31"),
        ("0 0 * 13 *", "cron month field '13': 13 is out of range 1-12 or jan-dec"),
        ("0 0 * smarch *", "cron month field 'smarch': 'smarch' is not a value in 1-12 or jan-dec"),
        ("0 0 * * 8", "cron day-of-week field '8': 8 is out of range 0-7 or sun-sat"),
        ("5-1 * * * *", "cron minute field '5-1': the range 5-1 runs backwards"),
        ("1,,2 * * * *", "cron minute field '1,,2': '' is not *, a value, a range a-b, or one"),
        ("* * * *", "cron '* * * *' has 4 fields; it needs five"),
        # every field in range, yet no date matches (was a 500 at create)
        ("0 0 30 2 *", "cron '0 0 30 2 *' never fires: no date matches it"),
        ("0 0 31 4,6 *", "cron '0 0 31 4,6 *' never fires: no date matches it"),
    ],
)
def test_cron_fields_are_checked_by_range_steps_included(cron: str, message: str) -> None:
    spec = ScheduleSpec(name="n", type="echo", cron=cron)
    with pytest.raises(InvalidRequest) as info:
        validate(spec, min_interval=1, max_payload=1000)
    assert info.value.field == "cron" and str(info.value).startswith(message)


@pytest.mark.parametrize(
    "cron",
    [
        "*/59 * * * *", "0 9-17/2 * * 1-5", "30 5 1,15 * *", "0 0 L * *", "0 0 * * 5#2",
        "0 0 * JAN,jul mon-fri", "0 0 * * 7", "0 0 * * sun", "15 */23 */31 */12 */7",
        "0 0 29 2 *",  # every fourth year
    ],
)  # fmt: skip
def test_good_cron_expressions_pass(cron: str) -> None:
    validate(ScheduleSpec(name="n", type="echo", cron=cron), min_interval=1, max_payload=1000)


def test_dates_round_inward_to_the_millisecond() -> None:
    """A start a fraction of a ms before a slot does not let in the slot before it, and an end
    a fraction after one does not let in the slot after it: the start rounds up, the end down."""
    from jobtier.core.model import Priority
    from jobtier.core.schedule import Schedule
    from jobtier.engine.cron import mirror_def

    noon = datetime(2031, 6, 1, 12, tzinfo=UTC)
    schedule = Schedule(
        id="S", tenant="t", name="n", type="echo", payload=None, priority=Priority.NORMAL,
        max_attempts=None, cron="0 12 * * *", timezone="UTC", interval=None,
        misfire="fire_once", paused=False, created_at=noon, updated_at=noon,
        next_fire_at=None, last_fired_at=None,
        start_at=noon - timedelta(microseconds=400), end_at=noon + timedelta(microseconds=600),
    )  # fmt: skip
    d = mirror_def(schedule, 3)
    noon_ms = round(noon.timestamp() * 1000)
    assert (d.start_ms, d.end_ms) == (noon_ms, noon_ms)
    later = msgspec.structs.replace(
        schedule,
        start_at=noon + timedelta(microseconds=400),
        end_at=noon - timedelta(microseconds=600) + timedelta(days=1),
    )
    d = mirror_def(later, 3)
    assert (d.start_ms, d.end_ms) == (noon_ms + 1, noon_ms + 86_400_000 - 1)
    assert (
        d.timing().next_after(noon_ms - 5) is None
    )  # noon is before its start, the next after its end
