"""The status tier: near cache, then per-tick coalescing (the singleflight of the read path),
composed by StatusReader (reader.py); the HTTP answer (answer.py) and the fast path that
sends it ahead of Starlette (fastpath.py)."""

from jobtier.status.coalescer import Coalescer
from jobtier.status.nearcache import Entry, NearCache
from jobtier.status.reader import Fallback, Listener, Status, StatusReader, parse_version
from jobtier.status.singleflight import LoadCancelled

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
