"""Reading a job's flow: its dependencies and their outcomes, its compensation job."""

from __future__ import annotations

from typing import cast

import msgspec

from jobtier.core.errors import JobNotFound
from jobtier.core.model import RESULT_REF, Dependency, JobError
from jobtier.core.sealing import Keyring, is_envelope, open_value
from jobtier.store.context import Store

# lib.lua's state marks (upper case: a child of the job)
MARKS = {"s": "succeeded", "f": "failed", "c": "cancelled", "m": "missing"}
_error_decoder = msgspec.json.Decoder(JobError)


def dependency(dep_id: str, state: str, data: bytes, child: bool) -> Dependency:
    """One dependency from its outcome: the result of a success, else the error."""
    if state == "succeeded":
        if data[:1] == RESULT_REF:
            # kept in the result store: not copied into the dependent, which reads it there
            url = f"/v1/jobs/{dep_id}/result/content"
            return Dependency(id=dep_id, state=state, child=child, result_url=url)
        result = msgspec.json.decode(data) if data else None
        return Dependency(id=dep_id, state=state, result=result, child=child)
    error = None
    if data:
        try:
            error = _error_decoder.decode(data)
        except msgspec.DecodeError:  # not ours: keep the job readable
            error = JobError("Error", data.decode(errors="replace")[:2000])
    return Dependency(id=dep_id, state=state, error=error, child=child)


def open_dependency(dep: Dependency, keyring: Keyring | None) -> Dependency:
    """``dep`` with its encrypted result opened (``SealError`` when it cannot be): for the
    worker and the tenant, who hold the keys (docs/encryption.md)."""
    if not is_envelope(dep.result):
        return dep
    return msgspec.structs.replace(dep, result=open_value(keyring, dep.id, "result", dep.result))


def opened(deps: dict[str, Dependency], keyring: Keyring | None) -> dict[str, Dependency]:
    """``open_dependency`` of each of ``deps``."""
    return {dep_id: open_dependency(dep, keyring) for dep_id, dep in deps.items()}


def from_stored(dep_id: str, value: bytes | None) -> Dependency:
    """A dependency from its entry in jt:{s}:deps:<id> (lib.lua's flows section)."""
    if value is None or value in (b"0", b"1"):
        return Dependency(id=dep_id, state="pending", child=value == b"1")
    mark = chr(value[0])
    return dependency(dep_id, MARKS.get(mark.lower(), "missing"), value[1:], mark.isupper())


def from_inputs(inputs: tuple[bytes, list[bytes]] | None) -> dict[str, Dependency]:
    """What claim.lua hands a worker (lib.lua flow_inputs), by id, in order."""
    if not inputs:
        return {}
    ids, flat = inputs
    stored = dict(zip(flat[0::2], flat[1::2], strict=True))
    return {dep: from_stored(dep, stored.get(dep.encode())) for dep in ids.decode().split()}


def stored_refs(inputs: tuple[bytes, list[bytes]] | None) -> dict[str, str]:
    """The result-store references of the dependencies whose results are kept there, by id,
    from what claim.lua hands a worker."""
    if not inputs:
        return {}
    _, flat = inputs
    return {
        dep.decode(): value[2:].decode()
        for dep, value in zip(flat[0::2], flat[1::2], strict=True)
        if value[:1] in (b"s", b"S") and value[1:2] == RESULT_REF
    }


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def dependencies(store: Store, job_id: str, tenant: str | None) -> list[Dependency]:
    owner, ids = await store.redis.hmget(store.keys.job(job_id), "tenant", "dids")
    if owner is None or (tenant is not None and _text(owner) != tenant):
        raise JobNotFound(job_id)
    if not ids:
        return []
    stored = cast(dict[bytes, bytes], await store.redis.hgetall(store.keys.deps(job_id)))
    return [from_stored(dep, stored.get(dep.encode())) for dep in _text(ids).split()]


async def compensation_of(store: Store, job_id: str) -> str | None:
    found = await store.redis.hget(store.keys.job(job_id), "cjob")
    return _text(found) if found is not None else None
