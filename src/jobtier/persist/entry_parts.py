"""The log entries a persister holds several transitions of, until each is written.

A script that makes several transitions logs them in one stream entry (store/lua/lib.lua,
write_log): its XACK is owed only once every one of them is in Postgres. A batch is never
cut inside an entry (``Persister._take``), but a row may be held on past its batch
(``holding.py``), and a batch may be written again in parts (``Persister._isolate``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jobtier.streams.acks import Acks
from jobtier.streams.entries import LogEntry


class EntryParts:
    """What is left of each entry of several transitions; ``acks`` is told when none is."""

    __slots__ = ("_left", "_refused", "acks")

    def __init__(self, acks: Acks) -> None:
        self.acks = acks
        # per (shard, entry id): its transitions not written yet, by job id and version
        self._left: dict[tuple[int, bytes], set[tuple[str, int]]] = {}
        self._refused: dict[tuple[int, bytes], str] = {}  # why one of them was refused

    def taken(self, parts: Sequence[LogEntry]) -> None:
        """The transitions of one entry, read (none, or every one, written before); what
        was known of it from an earlier read is replaced. (Transitions whose batch was not
        committed need nothing told here: they are still in their entry's set, so it is not
        acknowledged before they are written, though others of it are, held on past their
        batch: ``holding.py``; the entry, pending in Redis, is read again.)"""
        first = parts[0]
        key = (first.shard, first.entry_id)
        self._refused.pop(key, None)
        if len(parts) > 1:
            self._left[key] = {(e.status.id, e.status.version) for e in parts}

    def forget(self, shard: int, entry_id: bytes) -> None:
        """An entry gone from its stream (trimmed while pending): nothing left to write."""
        self._left.pop((shard, entry_id), None)
        self._refused.pop((shard, entry_id), None)

    def done(self, entries: Iterable[LogEntry]) -> None:
        """Transitions written (or refused: ``refused``): each entry is owed its XACK once
        every one of its transitions is, or its parking (``Acks.park``) if one was refused.
        Told by job and version, not counted: a transition held on may be written again by a
        copy read later (its entry let go and read again), and counts once."""
        left = self._left
        for e in entries:
            key = (e.shard, e.entry_id)
            parts = left.get(key)
            if parts is not None:
                parts.discard((e.status.id, e.status.version))
                if parts:
                    continue
                del left[key]
            if (why := self._refused.pop(key, None)) is None:
                self.acks.add(*key)
            else:
                self.acks.park(*key, why)

    def refused(self, entry: LogEntry, why: str) -> None:
        """Postgres refused ``entry`` alone: its stream entry is parked, not acknowledged,
        once the rest of its transitions are written."""
        self._refused[(entry.shard, entry.entry_id)] = why
        self.done([entry])
