"""Reading jobs and acting on them: status, result, payload, cancel, replay, dead letters,
log lines, dependencies."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any, Protocol

import msgspec

from jobtier.core.errors import Code, ConfigError, InvalidRequest, JobNotFound, TransitionRefused
from jobtier.core.model import Dependency, JobStatus, Priority, decode_status, is_ref, ref_of
from jobtier.core.sealing import unseal
from jobtier.flows import reads as flow_reads
from jobtier.status.docs import read_doc, read_docs
from jobtier.store.calls import parse_code_doc, promote_job_call, set_priority_call
from jobtier.store.context import Store


class ReplayedIds(list[str]):
    """``replay_many``'s answer: the ids replayed; ``held``: (id, holder) of the dead letters
    passed over because job ``holder`` holds their unique key."""

    held: list[tuple[str, str]] = []  # (replaced on each answer: never appended to)


class ResultReader(Protocol):
    """Where results kept outside Redis are read (``persist.results.PostgresResultStore``)."""

    async def get(self, ref: str) -> bytes | None: ...


def _changed(job_id: str, reply: tuple[Code, bytes], refusal: str) -> bytes:
    code, doc = reply
    if code is Code.NOT_FOUND:
        raise JobNotFound(job_id)
    if code is not Code.OK:
        raise TransitionRefused(code, job_id, refusal)
    return bytes(doc)


class JobControl:
    """Reads jobs and acts on them. A job of another tenant (``tenant`` given) is a
    ``JobNotFound``, exactly like an unknown id."""

    def __init__(self, store: Store, results: ResultReader | None = None) -> None:
        self.store = store
        self.results = results

    def _check_id(self, job_id: str) -> None:
        if not self.store.keys.valid_id(job_id):
            raise JobNotFound(job_id)

    async def _read(self, job_id: str, tenant: str | None, more: str = "") -> tuple[Any, ...]:
        """(status document, value of ``more``), or ``JobNotFound``."""
        self._check_id(job_id)
        owner, doc, *rest = await read_doc(self.store.redis, self.store.keys, job_id, more)
        if doc is None or (tenant is not None and owner != tenant.encode()):
            raise JobNotFound(job_id)
        return doc, *rest

    async def status_doc(self, job_id: str, tenant: str | None = None) -> bytes:
        """The status document as stored, or ``JobNotFound``."""
        (doc,) = await self._read(job_id, tenant)
        return doc if isinstance(doc, bytes) else str(doc).encode()

    async def status(self, job_id: str, tenant: str | None = None) -> JobStatus:
        return decode_status(await self.status_doc(job_id, tenant))

    async def result(self, job_id: str, tenant: str | None = None) -> tuple[JobStatus, Any]:
        """(status, result): the result is the task's return value once succeeded, else None."""
        doc, result = await self._read(job_id, tenant, "result")
        if is_ref(result):
            result = await self.stored_result(ref_of(result))
        if result:  # an encrypted one opened with this process's keys (docs/encryption.md)
            result = unseal(self.store.keyring, job_id, "result", result)
        return decode_status(doc), msgspec.json.decode(result) if result else None

    async def result_raw(self, job_id: str, tenant: str | None = None) -> tuple[JobStatus, bytes]:
        """(status, the result's JSON as stored — encrypted ones too, ``core/sealing.py`` —,
        b"" for none); b"" too for a result kept in the result store: the status's
        ``result_url`` says where it is."""
        doc, result = await self._read(job_id, tenant, "result")
        raw = result if isinstance(result, bytes) and not is_ref(result) else b""
        return decode_status(doc), raw

    async def stored_result(self, ref: str) -> bytes | None:
        """A result kept in the result store (None once the store no longer holds it)."""
        if self.results is None:
            raise ConfigError(
                "this job's result is kept in the result store, and no reader of it was "
                "given: pass results=PostgresResultStore (jobtier.persist.results)"
            )
        return await self.results.get(ref)

    async def payload(self, job_id: str) -> Any:
        self._check_id(job_id)
        raw = await self.store.redis.hget(self.store.keys.job(job_id), "payload")
        if raw is None:
            raise JobNotFound(job_id)
        data = raw if isinstance(raw, bytes) else raw.encode()
        return msgspec.json.decode(unseal(self.store.keyring, job_id, "payload", data))

    async def cancel(self, job_id: str, tenant: str | None = None) -> JobStatus:
        """Cancel a waiting job, or ask the worker running it to stop. Raises
        ``JobNotFound``, or ``TransitionRefused(WRONG_STATE)`` once it has finished."""
        return decode_status(await self.cancel_doc(job_id, tenant))

    async def cancel_doc(self, job_id: str, tenant: str | None = None) -> bytes:
        """``cancel``, returning the status document as stored."""
        self._check_id(job_id)
        reply = await self.store.scripts.cancel(
            self.store.keys.shard_of(job_id),
            tenant or "",
            job_id,
            self.store.settings.retention_seconds,
        )
        return _changed(job_id, reply, "has already finished")

    async def replay(self, job_id: str, tenant: str | None = None) -> JobStatus:
        """Send a dead-lettered (failed) job back to its queue with its attempts reset."""
        return decode_status(await self.replay_doc(job_id, tenant))

    async def replay_doc(self, job_id: str, tenant: str | None = None) -> bytes:
        """``replay``, returning the status document as stored."""
        self._check_id(job_id)
        shard = self.store.keys.shard_of(job_id)
        code, doc = reply = await self.store.scripts.replay(shard, tenant or "", job_id)
        if code is Code.EXISTS:  # replay.lua: its unique key is another job's
            holder = bytes(doc).decode()
            why = f"its unique key is held by job {holder}: replay it once that job has finished"
            raise TransitionRefused(code, job_id, why, reason=f"job {job_id}: {why}", holder=holder)
        return _changed(job_id, reply, "is not in the dead-letter set")

    async def promote(self, job_id: str, tenant: str | None = None) -> JobStatus:
        """Run a scheduled job now (a delayed one before its run-at, or one waiting out a
        retry's back-off): ``TransitionRefused(WRONG_STATE)`` for a job in another state."""
        return decode_status(await self.promote_doc(job_id, tenant))

    async def promote_doc(self, job_id: str, tenant: str | None = None) -> bytes:
        """``promote``, returning the status document as stored."""
        self._check_id(job_id)
        call = promote_job_call(self.store.keys.shard_of(job_id), tenant or "", job_id)
        return _changed(
            job_id, parse_code_doc(await self.store.scripts.call(*call)), "is not scheduled"
        )

    async def set_priority(
        self, job_id: str, priority: Priority | str, tenant: str | None = None
    ) -> JobStatus:
        """Change the priority of a job not started yet: a ready one goes to the back of its
        new priority's jobs; ``TransitionRefused(WRONG_STATE)`` once it runs or has ended."""
        return decode_status(await self.set_priority_doc(job_id, priority, tenant))

    async def set_priority_doc(
        self, job_id: str, priority: Priority | str, tenant: str | None = None
    ) -> bytes:
        """``set_priority``, returning the status document as stored."""
        self._check_id(job_id)
        try:
            value = Priority(priority).value
        except ValueError:
            names = ", ".join(p.value for p in Priority)
            raise InvalidRequest(f"priority must be one of {names}", field="priority") from None
        shard = self.store.keys.shard_of(job_id)
        reply = await self.store.scripts.call(
            *set_priority_call(shard, tenant or "", job_id, value)
        )
        return _changed(job_id, parse_code_doc(reply), "has started or ended")

    async def dead_letters(
        self,
        limit: int = 100,
        *,
        type: str | None = None,
        since: datetime | None = None,
        queue: str | None = None,
        tenant: str | None = None,
    ) -> list[JobStatus]:
        """The most recently dead-lettered jobs still in Redis, newest first; only those of
        ``type``, ``queue`` and ``tenant``, dead-lettered at or after ``since``, when given."""
        # each shard's set is read newest first, a page at a time, until enough match
        keys, redis = self.store.keys, self.store.redis
        page = max(limit, 100)
        low: float | str = "-inf" if since is None else int(since.timestamp() * 1000)
        offsets = dict.fromkeys(range(keys.shards), 0)
        found: list[tuple[float, JobStatus]] = []
        while offsets and len(found) < limit:
            pipe = redis.pipeline(transaction=False)
            for shard, start in offsets.items():
                pipe.zrevrangebyscore(
                    keys.dead(shard), "+inf", low, start=start, num=page, withscores=True
                )
            entries = []
            for shard, rows in zip(list(offsets), await pipe.execute(), strict=True):
                entries += [(score, member.decode()) for member, score in rows]
                if len(rows) < page:
                    del offsets[shard]
                else:
                    offsets[shard] += page
            entries.sort(reverse=True)
            docs = await read_docs(redis, keys, [job_id for _, job_id in entries])
            for (score, _), (owner, doc) in zip(entries, docs, strict=True):
                if doc is None:  # expired from Redis (dead retention): Postgres still has it
                    continue
                status = decode_status(doc)
                if (
                    (type is None or status.type == type)
                    and (queue is None or status.queue == queue)
                    and (tenant is None or owner == tenant.encode())
                ):
                    found.append((score, status))
        found.sort(key=lambda item: -item[0])
        return [status for _, status in found[:limit]]

    async def replay_many(
        self,
        *,
        type: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
        queue: str | None = None,
        tenant: str | None = None,
    ) -> ReplayedIds:
        """Replay the dead letters ``dead_letters`` selects; returns the ids replayed (a list),
        with ``.held`` the (id, holder) of those passed over because another job holds their
        unique key."""
        replayed, held = ReplayedIds(), []
        for status in await self.dead_letters(
            limit, type=type, since=since, queue=queue, tenant=tenant
        ):
            try:
                await self.replay(status.id)
            except TransitionRefused as exc:
                if exc.holder is not None:
                    held.append((status.id, exc.holder))
                continue  # else replayed meanwhile
            except JobNotFound:
                continue  # expired meanwhile
            replayed.append(status.id)
        replayed.held = held
        return replayed

    async def dead_letter(self, job_id: str) -> tuple[bytes, bytes, list[bytes]]:
        """One dead-lettered job in full: (status document, payload JSON, log lines JSON);
        ``JobNotFound`` unless Redis holds it in its dead-letter set."""
        self._check_id(job_id)
        keys, redis = self.store.keys, self.store.redis
        pipe = redis.pipeline(transaction=False)
        pipe.zscore(keys.dead(keys.shard_of(job_id)), job_id)
        pipe.lrange(keys.lines(job_id), 0, -1)
        (score, lines), (_, doc, payload) = await asyncio.gather(
            pipe.execute(), read_doc(redis, keys, job_id, "payload")
        )
        if score is None or doc is None:
            raise JobNotFound(job_id)
        return doc, payload or b"null", lines

    async def log_lines(self, job_id: str) -> list[bytes]:
        """The job's log lines (``ctx.log``) still in Redis, oldest first, JSON each."""
        self._check_id(job_id)
        lines = await self.store.redis.lrange(self.store.keys.lines(job_id), 0, -1)
        return [line if isinstance(line, bytes) else line.encode() for line in lines]

    async def dependencies(
        self, job_id: str, tenant: str | None = None, *, reveal: bool = True
    ) -> list[Dependency]:
        """A job's dependencies, in order, with their state (and result or error once they
        finished). ``JobNotFound`` for a job Redis does not hold (or another tenant's).
        Encrypted results are opened, unless not to ``reveal`` them (then left sealed)."""
        self._check_id(job_id)
        found = await flow_reads.dependencies(self.store, job_id, tenant)
        if not reveal:
            return found
        keyring = self.store.keyring
        return [flow_reads.open_dependency(dep, keyring) for dep in found]

    async def compensation_of(self, job_id: str) -> str | None:
        """The id of the compensation job created when ``job_id`` failed for good, or None."""
        self._check_id(job_id)
        return await flow_reads.compensation_of(self.store, job_id)
