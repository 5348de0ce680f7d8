"""The Lua library's date rendering, checked against Python on the real Redis."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import cast

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from jobtier.store.scripts import lua_source
from tests.fixtures.redis import StreamEntries, as_jobtier


async def test_iso_matches_python(redis: aioredis.Redis) -> None:
    script = (
        lua_source("lib")
        + "\nlocal out = {}\nfor i = 2, #ARGV do out[#out + 1] = iso(ARGV[i]) end\nreturn out"
    )
    samples = [0, 1, 999, 1000, 86_399_999, 951_782_400_000, 4_102_444_799_999, 1_795_953_934_315]
    samples += list(range(1_709_164_800_000, 1_709_164_800_000 + 86_400_000 * 3, 86_400_000 // 7))
    got = await redis.eval(script, 1, "jt:{0}:log", "jt:{0}:", *samples)
    for ms, text in zip(samples, got, strict=True):
        expected = (
            datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
            + f"{ms % 1000:03d}Z"
        )
        assert text.decode() == expected, ms


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 7_258_118_399_999), min_size=1, max_size=50))
def test_iso_matches_python_for_any_date(redis_server, samples: list[int]) -> None:  # type: ignore[no-untyped-def]
    import redis as syncredis

    script = (
        lua_source("lib")
        + "\nlocal out = {}\nfor i = 2, #ARGV do out[#out + 1] = iso(ARGV[i]) end\nreturn out"
    )
    with syncredis.Redis.from_url(as_jobtier(redis_server.url)) as client:
        got = client.eval(script, 1, "jt:{0}:log", "jt:{0}:", *samples)
    for ms, text in zip(samples, got, strict=True):
        expected = (
            datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
            + f"{ms % 1000:03d}Z"
        )
        assert text.decode() == expected, ms


async def test_a_call_that_fails_half_way_logs_what_it_changed_and_keeps_its_error(
    redis: aioredis.Redis,
) -> None:
    """A script's body runs inside lib.lua's logged(): the log entries it kept are written
    though it fails after them (Redis does not roll a script back, so what it changed stays
    changed), and a failed command's error reaches the caller as it was, its code kept."""
    await redis.delete("jt:{0}:log", "jt:{0}:k")
    await redis.set("jt:{0}:k", "not a number")
    script = lua_source("lib") + (
        "\nbegin(ARGV)\nreturn logged(pcall(function()\n"
        "  log_entry('{}', 't1', '', 'api', 0, {'p', '[1]'})\n"
        "  log_entry('{}', 't2', 'queued', 'w1', 1)\n"
        "  if ARGV[2] == 'raise' then error('plain') end\n"
        "  return redis.call('INCR', 'jt:{0}:k')\n"
        "end))"
    )
    with pytest.raises(ResponseError) as failed:
        await redis.eval(script, 1, "jt:{0}:log", "jt:{0}:", "incr")
    assert str(failed.value) == "value is not an integer or out of range"  # not "ERR ERR …"
    with pytest.raises(ResponseError, match="plain"):
        await redis.eval(script, 1, "jt:{0}:log", "jt:{0}:", "raise")
    entries = cast(StreamEntries, await redis.xrange("jt:{0}:log"))
    assert len(entries) == 2
    for _, fields in entries:
        assert fields[b"n"] == b"2" and fields[b"p1"] == b"[1]" and fields[b"tn2"] == b"t2"
