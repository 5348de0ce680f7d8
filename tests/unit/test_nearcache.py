"""NearCache: bounded size, no version regression, TTL, events only for present ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobtier.status.nearcache import Entry, NearCache
from jobtier.status.reader import parse_version


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(version: int, at: float = 100.0, tenant: str = "t1") -> Entry:
    return Entry(tenant, version, b'{"version":%d}' % version, at)


def test_get_put_and_counters() -> None:
    cache = NearCache(maxsize=10, ttl=2.0)
    assert cache.get("a", 100.0) is None
    assert cache.put("a", entry(1))
    got = cache.get("a", 100.5)
    assert got is not None and (got.tenant, got.version) == ("t1", 1)
    assert (cache.hits, cache.misses) == (1, 1)
    assert "a" in cache and len(cache) == 1


def test_ttl_expiry() -> None:
    cache = NearCache(maxsize=10, ttl=2.0)
    cache.put("a", entry(1, at=100.0))
    assert cache.get("a", 102.0) is not None  # exactly at the TTL: still served
    assert cache.get("a", 102.01) is None
    assert cache.expired == 1 and cache.misses == 1
    assert "a" not in cache  # dropped on read


def test_no_version_regression() -> None:
    cache = NearCache(maxsize=10, ttl=2.0)
    cache.put("a", entry(5))
    assert not cache.put("a", entry(4, at=100.5))  # a slow load answered before the event
    got = cache.get("a", 100.5)
    assert got is not None and got.version == 5
    assert cache.put("a", entry(5, at=101.0))  # same version refreshes stored_at
    assert cache.put("a", entry(6, at=101.0))
    got = cache.get("a", 101.0)
    assert got is not None and got.version == 6


def test_an_expired_entry_does_not_block_an_older_version() -> None:
    """Past its TTL an entry is not trusted (e.g. Redis lost writes): what was loaded wins."""
    cache = NearCache(maxsize=10, ttl=2.0)
    cache.put("a", entry(5, at=100.0))
    assert cache.put("a", entry(3, at=103.0))
    got = cache.get("a", 103.0)
    assert got is not None and got.version == 3


def test_on_event_only_for_present_ids() -> None:
    clock = Clock()
    cache = NearCache(maxsize=10, ttl=2.0, clock=clock)
    assert not cache.on_event("a", 2, "t1", b"doc2")
    assert "a" not in cache and len(cache) == 0
    cache.put("a", entry(1))
    clock.now = 101.5
    assert cache.on_event("a", 2, "t1", b"doc2")
    got = cache.get("a", 101.5)
    assert got == Entry("t1", 2, b"doc2", 101.5)  # stored_at refreshed by the event
    assert not cache.on_event("a", 2, "t1", b"doc2")  # duplicate: not advanced
    assert not cache.on_event("a", 1, "t1", b"doc1")  # older: ignored
    got = cache.get("a", 101.5)
    assert got is not None and got.version == 2
    assert cache.events_applied == 1


def test_bounded_size_evicts_oldest_first() -> None:
    cache = NearCache(maxsize=128, ttl=10.0)
    for i in range(128):
        cache.put(f"j{i}", entry(1))
    assert len(cache) == 128
    cache.put("new", entry(1))
    assert len(cache) <= 128 and "new" in cache
    assert "j0" not in cache and "j127" in cache  # the oldest go first (2 = 128 // 64)
    assert cache.evictions == 2
    cache.put("j127", entry(2))  # replacing a present id evicts nothing
    assert cache.evictions == 2


@given(
    st.lists(
        st.tuples(st.sampled_from("abcdefghij"), st.integers(1, 20), st.booleans()),
        max_size=200,
    ),
    st.integers(1, 6),
)
def test_never_over_size_never_regresses(ops: list[tuple[str, int, bool]], maxsize: int) -> None:
    cache = NearCache(maxsize=maxsize, ttl=1e9)
    newest: dict[str, int] = {}
    for job_id, version, is_event in ops:
        if is_event:
            cache.on_event(job_id, version, "t", b"")
        else:
            cache.put(job_id, entry(version))
        assert len(cache) <= maxsize
        for held in list(newest):
            if held not in cache:
                del newest[held]  # evicted: a later put starts over
        got = cache.get(job_id, 100.0)
        if got is not None:
            # whatever is held is at least as new as anything held for it before
            assert got.version >= newest.get(job_id, 0)
            newest[job_id] = got.version


def test_clear_bumps_generation() -> None:
    cache = NearCache(maxsize=10)
    cache.put("a", entry(1))
    generation = cache.generation
    cache.clear()
    assert len(cache) == 0 and cache.generation == generation + 1


def test_bad_size() -> None:
    with pytest.raises(ValueError):
        NearCache(maxsize=0)


def test_parse_version() -> None:
    doc = (
        b'{"id":"01M8KK4FZ54RBHFVYBN6HBV0CZ-7","type":"a\\",\\"version\\":9",'
        b'"state":"queued","version":12,"priority":"normal"}'
    )
    assert parse_version(doc) == 12
    assert parse_version(b'{"version":3}') == 3
    with pytest.raises(ValueError):
        parse_version(b'{"id":"x"}')


def test_final_entries_live_for_final_ttl_and_others_for_ttl() -> None:
    cache = NearCache(maxsize=10, ttl=2.0, final_ttl=600.0)
    cache.put("final", Entry("t1", 3, b'{"version":3}', 100.0, final=True))
    cache.put("plain", entry(1, at=100.0))
    assert cache.get("plain", 102.5) is None
    assert cache.get("final", 102.5) is not None
    assert cache.get("final", 700.0) is not None  # exactly at final_ttl
    assert cache.get("final", 700.01) is None


def test_final_ttl_is_never_shorter_than_ttl_and_size_still_bounds_it() -> None:
    assert NearCache(maxsize=10, ttl=2.0, final_ttl=1.0).final_ttl == 2.0
    cache = NearCache(maxsize=64, ttl=2.0, final_ttl=600.0)
    for i in range(65):
        cache.put(f"j{i}", Entry("t1", 1, b"{}", 100.0, final=True))
    assert len(cache) <= 64 and "j64" in cache


def test_is_terminal_reads_the_state_field() -> None:
    from jobtier.status.reader import is_terminal

    for state in ("succeeded", "failed", "cancelled"):
        assert is_terminal(b'{"id":"x","type":"t","queue":"q","state":"%s"}' % state.encode())
    for state in ("queued", "running", "scheduled"):
        assert not is_terminal(b'{"id":"x","type":"t","queue":"q","state":"%s"}' % state.encode())
    # a type that spells a state inside it is escaped JSON: never mistaken for the field
    assert not is_terminal(b'{"id":"x","type":"a\\",\\"state\\":\\"failed","state":"queued"}')
