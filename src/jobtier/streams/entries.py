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
    entry_id: bytes
    status: JobStatus
    doc: bytes
    tenant: str
    from_state: str | None  # None for the submit entry
    actor: str  # worker id, 'api', 'scheduler', 'admin'
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

    @property
    def ms(self) -> int:
        """When the transition happened: the stream id's Redis-clock milliseconds."""
        return int(self.entry_id.split(b"-", 1)[0])


# what parse_entry raises for a malformed entry (a field missing, or not what it should be)
MALFORMED = (KeyError, ValueError, UnicodeDecodeError, msgspec.DecodeError)


def parse_entry(shard: int, entry_id: bytes, fields: dict[bytes, bytes]) -> LogEntry:
    """Decode one stream entry; raises one of ``MALFORMED`` on a malformed one."""
    doc = fields[b"d"]
    status = status_decoder.decode(doc)
    ik = fields.get(b"ik")
    pv = fields.get(b"pv")
    dp = fields.get(b"dp")
    dk = fields.get(b"dk")
    # positional: a Struct builds faster from positions than from keywords
    return LogEntry(
        shard,
        entry_id,
        status,
        doc,
        fields[b"tn"].decode(),
        fields[b"fr"].decode() or None,
        fields[b"w"].decode(),
        int(pv) if pv is not None else None,
        fields.get(b"p"),
        ik.decode() if ik else None,
        fields.get(b"r"),
        dp.decode().split() if dp else None,
        dk.decode() if dk else "",
        b"rl" in fields,
        fields.get(b"cp"),
    )


_ENTRY_ID = operator.attrgetter("entry_id")


def age(entries: Sequence[LogEntry]) -> float:
    """Seconds since the oldest of ``entries`` happened: its id, Redis's clock against ours,
    as ``group.lag`` reads it. The least id is the oldest, compared as bytes (their
    milliseconds have 13 digits until 2286): only it is parsed, on the persister's hot path."""
    if not entries:
        return 0.0
    return max(0.0, time.time() - min(entries, key=_ENTRY_ID).ms / 1000)
