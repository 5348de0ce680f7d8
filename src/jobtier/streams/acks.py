"""What a consumer owes Redis once its work is done: acknowledgements, and parking.

An entry is acknowledged (XACK, and XDEL for a group that deletes what it has handled) only
once its work is done, or when there is nothing left to do (pending, but trimmed from its
stream meanwhile). An entry the persister's Postgres refused for its data is first copied,
with the error, to its shard's ``log:refused`` stream (``jobtier persister --replay-refused``
sends it back), then acknowledged. Whatever fails on the way stays owed and is sent again on
the next flush: a second XACK, or a second copy of a parked entry, is harmless; a lost one
would hold back trimming of the stream for good.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jobtier.store.redis import RedisClient


class Acks:
    """The XACKs and parkings one consumer owes, per shard, sent by ``flush``."""

    def __init__(
        self,
        redis: RedisClient,
        streams: Sequence[str],
        group: str,
        *,
        refused: Sequence[str] = (),
        delete: bool = False,
    ) -> None:
        self.redis = redis
        self.streams = streams  # per shard: its stream
        self.refused = refused  # per shard: where its refused entries are parked
        self.group = group
        self.delete = delete  # XDEL what is acknowledged (no other group reads the stream)
        self.parked = 0  # entries parked so far
        self._to_ack: dict[int, list[bytes]] = {}  # done, XACK not yet confirmed
        self._to_park: dict[int, list[tuple[bytes, str]]] = {}  # refused: (id, error)

    def __bool__(self) -> bool:
        return bool(self._to_ack or self._to_park)

    def add(self, shard: int, entry_id: bytes) -> None:
        """Owe an XACK for this entry (its work is done, or it has none left)."""
        self._to_ack.setdefault(shard, []).append(entry_id)

    def add_many(self, entries: Iterable[tuple[int, bytes]]) -> None:
        """``add`` for each (shard, entry id)."""
        to_ack = self._to_ack
        for shard, entry_id in entries:
            ids = to_ack.get(shard)
            if ids is None:
                ids = to_ack[shard] = []
            ids.append(entry_id)

    def park(self, shard: int, entry_id: bytes, error: str) -> None:
        """Owe a copy of this refused entry to ``log:refused`` (with ``error``), then its XACK."""
        self._to_park.setdefault(shard, []).append((entry_id, error[:2000]))

    async def flush(self) -> dict[int, list[bytes]]:
        """Park what was refused, then acknowledge everything owed (one pipeline each); the
        ids acknowledged, per shard."""
        if self._to_park:
            await self._park()
        if not self._to_ack:
            return {}
        todo, self._to_ack = self._to_ack, {}
        pipe = self.redis.pipeline(transaction=False)
        for shard, ids in todo.items():
            pipe.xack(self.streams[shard], self.group, *ids)
            if self.delete:
                pipe.xdel(self.streams[shard], *ids)
        try:
            await pipe.execute()
        except BaseException:
            # done but not acknowledged: keep the ids; doing it again would be harmless anyway
            for shard, ids in todo.items():
                self._to_ack.setdefault(shard, []).extend(ids)
            raise
        return todo

    async def _park(self) -> None:
        """Copy the refused entries to ``log:refused`` and owe their XACKs."""
        todo, self._to_park = self._to_park, {}
        try:
            pipe = self.redis.pipeline(transaction=False)
            order = [
                (shard, entry_id, error) for shard, es in todo.items() for entry_id, error in es
            ]
            for shard, entry_id, _ in order:
                pipe.xrange(self.streams[shard], min=entry_id, max=entry_id)
            found = await pipe.execute()
            pipe = self.redis.pipeline(transaction=False)
            for (shard, entry_id, error), entries in zip(order, found, strict=True):
                if entries:  # else trimmed already: nothing left to park
                    fields = dict(entries[0][1])
                    fields[b"refused_from"] = entry_id
                    fields[b"refused_error"] = error.encode()
                    pipe.xadd(self.refused[shard], fields)
            await pipe.execute()
        except BaseException:
            for shard, es in todo.items():  # parked again next time: a duplicate at worst
                self._to_park.setdefault(shard, []).extend(es)
            raise
        for shard, entry_id, _ in order:
            self.add(shard, entry_id)
        self.parked += len(order)
