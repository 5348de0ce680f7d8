"""The entries of the transition logs (``jt:{s}:log``), decoded: what the persister writes
to Postgres and the dispatcher turns into webhooks."""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence

import msgspec

from jobtier.core.model import JobStatus, status_decoder


class LogEntry(msgspec.Struct, gc=False):
    """One decoded log stream entry (see ``store/lua/lib.lua: commit`` for the fields).

    A Struct rather than a dataclass, and left out of the garbage collector (it refers to no
    container that could make a cycle): a persister makes one per transition, tens of
    thousands a second (tests/unit/test_persist_batch.py checks the collector ignores it).
    """

    shard: int
    entry_id: bytes  # the stream entry it came in, which it may share with others of one call
    status: JobStatus
    doc: bytes
    tenant: str
    from_state: str | None  # None for the submit entry
    actor: str  # worker id, 'api', 'scheduler', 'admin', 'resolver', 'expiry', …
    # the job's previous logged version (0 for the submit); None from a jobtier that logged
    # every version, so version - 1 (queries.sql: history_gaps)
    prev_version: int | None = None
    payload: bytes | None = None  # submit only
    idempotency_key: str | None = None  # submit only, when given
    result: bytes | None = None  # success only; b"" means a null result
    dependencies: list[str] | None = None  # submit of a job that waits for others
    children: str = ""  # per dependency, '1' for a child of the job (same flow), else '0'
    released: bool = False  # running -> queued by a worker that stopped, nothing failed
    checkpoint: bytes | None = None  # the state a checkpoint saved (heartbeat.lua 'cp')
    # running -> scheduled with the attempt given back (fail.lua 'rf': jobtier's RateLimited,
    # an open breaker), not failed
    refunded: bool = False

    @property
    def ms(self) -> int:
        """When the transition happened: the stream id's Redis-clock milliseconds."""
        return int(self.entry_id.split(b"-", 1)[0])


# what parse_entry raises for a malformed entry (a field missing, or not what it should be)
MALFORMED = (KeyError, ValueError, UnicodeDecodeError, msgspec.DecodeError)

# A script that makes several transitions logs them in one entry (store/lua/lib.lua,
# write_log): 'n' their number, and each one's fields named with its place after the name,
# 1 to n ('d1', 'tn1', …). NAMES[i]: the names of place i (0: an entry of one transition).
_FIELDS = ("d", "tn", "fr", "w", "pv", "p", "ik", "r", "dp", "dk", "rl", "cp", "rf")
PARTS_MOST = 100  # lib.lua's LOG_MOST: an entry of more is malformed
NAMES = [tuple(f.encode() for f in _FIELDS)] + [
    tuple(f"{f}{i}".encode() for f in _FIELDS) for i in range(1, PARTS_MOST + 1)
]


def parse_entry(shard: int, entry_id: bytes, fields: dict[bytes, bytes]) -> LogEntry:
    """Decode an entry of one transition; raises one of ``MALFORMED`` on a malformed one."""
    return _parse(shard, entry_id, fields, NAMES[0])


def _places(fields: dict[bytes, bytes]) -> list[tuple[bytes, ...]]:
    """The field names of each transition of an entry, in the order they were made; raises
    ValueError for a count no entry holds."""
    n = fields.get(b"n")
    if n is None:
        return NAMES[:1]
    count = int(n)
    if not 1 <= count <= PARTS_MOST:
        raise ValueError(f"an entry of {count} transitions")
    return NAMES[1 : count + 1]


def parse_entries(shard: int, entry_id: bytes, fields: dict[bytes, bytes]) -> list[LogEntry]:
    """Decode an entry: its transitions, in the order they were made (one, or the ``n`` of an
    entry of several); raises one of ``MALFORMED`` on a malformed one."""
    return [_parse(shard, entry_id, fields, names) for names in _places(fields)]


def transition_count(fields: dict[bytes, bytes]) -> int:
    """How many transitions an entry holds (1 for a malformed one, as a reader sees it)."""
    try:
        return len(_places(fields))
    except ValueError:
        return 1


def tenants(fields: dict[bytes, bytes]) -> list[bytes | None]:
    """The tenant of each transition of an entry (``parse_entries``'s order), undecoded; None
    where it has none (a malformed entry)."""
    try:
        return [fields.get(names[1]) for names in _places(fields)]
    except ValueError:
        return [None]


def _parse(
    shard: int, entry_id: bytes, fields: dict[bytes, bytes], names: tuple[bytes, ...]
) -> LogEntry:
    d, tn, fr, w, pv_, p, ik_, r, dp_, dk_, rl, cp, rf = names
    doc = fields[d]
    status = status_decoder.decode(doc)
    ik = fields.get(ik_)
    pv = fields.get(pv_)
    dp = fields.get(dp_)
    dk = fields.get(dk_)
    # positional: a Struct builds faster from positions than from keywords
    return LogEntry(
        shard,
        entry_id,
        status,
        doc,
        fields[tn].decode(),
        fields[fr].decode() or None,
        fields[w].decode(),
        int(pv) if pv is not None else None,
        fields.get(p),
        ik.decode() if ik else None,
        fields.get(r),
        dp.decode().split() if dp else None,
        dk.decode() if dk else "",
        rl in fields,
        fields.get(cp),
        rf in fields,
    )


def split_fields(fields: dict[bytes, bytes]) -> list[dict[bytes, bytes]]:
    """An entry's fields per transition, each named as in an entry of one (tests, tools: the
    log read as it was written before entries held several)."""
    return [
        {name: fields[own] for name, own in zip(NAMES[0], names, strict=True) if own in fields}
        for names in _places(fields)
    ]


_ENTRY_ID = operator.attrgetter("entry_id")


def age(entries: Sequence[LogEntry]) -> float:
    """Seconds since the oldest of ``entries`` happened: its id, Redis's clock against ours,
    as ``group.lag`` reads it. The least id is the oldest, compared as bytes (their
    milliseconds have 13 digits until 2286): only it is parsed, on the persister's hot path."""
    if not entries:
        return 0.0
    return max(0.0, time.time() - min(entries, key=_ENTRY_ID).ms / 1000)
