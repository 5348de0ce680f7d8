"""The status read path: near cache, singleflight, per-tick coalescing, composed by StatusReader."""

from jobtier.cache.coalescer import Coalescer
from jobtier.cache.nearcache import Entry, NearCache
from jobtier.cache.redis_reader import Fallback, Listener, Status, StatusReader, parse_version
from jobtier.cache.singleflight import LoadCancelled, SingleFlight

__all__ = [
    "Coalescer",
    "Entry",
    "Fallback",
    "Listener",
    "LoadCancelled",
    "NearCache",
    "SingleFlight",
    "Status",
    "StatusReader",
    "parse_version",
]
