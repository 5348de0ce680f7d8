"""The Lua library's date rendering, checked against Python on the real Redis."""

from __future__ import annotations

from datetime import UTC, datetime

import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from jobtier.store.scripts import lua_source
from tests.fixtures.redis import as_jobtier


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
