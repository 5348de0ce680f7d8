"""The status read path: near cache, then per-tick coalescing (the singleflight of the read
path), composed by StatusReader (redis_reader.py)."""

from jobtier.cache.coalescer import Coalescer
from jobtier.cache.nearcache import Entry, NearCache
from jobtier.cache.redis_reader import Fallback, Listener, Status, StatusReader, parse_version
from jobtier.cache.singleflight import LoadCancelled

__all__ = [
    "Coalescer",
    "Entry",
    "Fallback",
    "Listener",
    "LoadCancelled",
    "NearCache",
    "Status",
    "StatusReader",
    "parse_version",
]
