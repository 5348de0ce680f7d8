"""Submitting jobs that wait for others: the order of the steps, each safe to cut short.

A dependent and its dependencies may live on different shards (and Redis Cluster nodes),
and no script spans two shards, so a submit is a few steps, each one script call per shard
(pipelined), in an order that makes every prefix of them harmless:

1. (a flow with an idempotency key) the head alone: it holds the idempotency record, so a
   repeated submit finds it and finishes the rest (``plan.py``: ids derive from the head's);
2. the jobs that wait for others, ``waiting``, each in its shard's ``unlinked`` set with a
   deadline (``JOBTIER_FLOW_LINK_TIMEOUT_SECONDS``);
3. the jobs that wait for none, created knowing their dependents (they may finish at once:
   their dependents already exist to be told), and the links of the existing jobs named by
   ``depends_on`` (``link.lua``: registers the dependent, or hands off at once a job that
   has already finished, or one that does not exist);
4. ``linked.lua``: the dependents leave the ``unlinked`` sets (and the flow's head is marked
   done).

A submitter that dies between two steps leaves dependents in ``unlinked``; past their
deadline the resolver links them itself, and a dependency never created resolves as missing,
which cancels its dependent. A submit answers only after step 4.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from jobtier.core.errors import Code, IdempotencyConflict, InvalidRequest
from jobtier.core.model import CallbackSpec, FlowSubmitted, Submitted
from jobtier.flows.plan import FlowPlan, derive_id
from jobtier.status.docs import read_docs
from jobtier.store.calls import Call, SubmitItem, SubmitOutcome, link_call, linked_call
from jobtier.store.context import Store, in_order, submit_calls, submit_items

SUBMIT_CHUNK = 1000  # jobs per submit call (several calls per shard in one pipeline)
LINK_CHUNK = 2000  # links (or dependents) per link/linked call


def flow_blob(
    *,
    compensation: str = "",
    deps: Sequence[str] = (),
    children: int = 0,
    dependents: Sequence[str] = (),
    run_on_failure: bool = False,
    link_ms: int = 0,
) -> bytes:
    """The flow part of a submit (``lib.lua flow_create``): ``deps`` its dependencies, the
    first ``children`` of which are its children; ``dependents`` the jobs created with it
    that wait for it; ``compensation`` "<type> <queue> <attempts>". b"" for none of them."""
    blob: dict[str, Any] = {}
    if deps:
        blob["d"] = list(deps)
        blob["k"] = "1" * children + "0" * (len(deps) - children)
        blob["u"] = link_ms
        if run_on_failure:
            blob["o"] = "run"
    if dependents:
        blob["t"] = list(dependents)
    if compensation:
        blob["c"] = compensation
    return msgspec.json.encode(blob) if blob else b""


async def check_dependencies(store: Store, wanted: Iterable[tuple[str, str]], tenant: str) -> None:
    """Raise ``InvalidRequest`` (naming ``field``) for the first id of ``wanted`` ((field,
    id) pairs) that is not one of ``tenant``'s jobs held in Redis: another tenant's job is
    refused exactly as an unknown id."""
    pairs = list(wanted)
    if not pairs:
        return
    pipe = store.redis.pipeline(transaction=False)
    for _, job_id in pairs:
        pipe.hget(store.keys.job(job_id), "tenant")
    owners = await pipe.execute()
    for (field, job_id), owner in zip(pairs, owners, strict=True):
        if owner is None or owner.decode() != tenant:
            index = field.split("]", 1)[0] + "]: " if field.startswith("jobs[") else ""
            raise InvalidRequest(
                f"{index}depends_on names {job_id}, which is not a job of yours that Redis "
                f"still keeps (finished jobs stay {store.settings.retention_seconds} s: "
                "JOBTIER_RETENTION_SECONDS)",
                field=field,
            )


def link_calls(store: Store, tenant: str, links: Iterable[tuple[str, str]]) -> list[Call]:
    """link.lua calls for (dependency, dependent) pairs, by the dependency's shard."""
    by_shard: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for dep, dependent in links:
        by_shard[store.keys.shard_of(dep)].append((dep, dependent))
    return [
        link_call(shard, tenant, pairs[start : start + LINK_CHUNK])
        for shard, pairs in by_shard.items()
        for start in range(0, len(pairs), LINK_CHUNK)
    ]


def linked_calls(store: Store, dependents: Iterable[str], head: str = "") -> list[Call]:
    """linked.lua calls: the dependents off their shards' unlinked sets, the head marked."""
    by_shard: dict[int, list[str]] = defaultdict(list)
    for job_id in dependents:
        by_shard[store.keys.shard_of(job_id)].append(job_id)
    if head:
        by_shard.setdefault(store.keys.shard_of(head), [])
    head_shard = store.keys.shard_of(head) if head else -1
    calls = []
    for shard, ids in by_shard.items():
        chunks = [ids[s : s + LINK_CHUNK] for s in range(0, len(ids), LINK_CHUNK)] or [[]]
        for n, chunk in enumerate(chunks):
            mark = head if shard == head_shard and n == 0 else ""
            calls.append(linked_call(shard, chunk, mark))
    return calls


async def settle(
    store: Store, tenant: str, dependents: Sequence[tuple[str, Sequence[str]]]
) -> None:
    """Steps 3 and 4 for jobs created with ``depends_on`` alone (``Producer.submit_prepared``):
    link each (dependent, its dependencies), then take the dependents off ``unlinked``."""
    if not dependents:
        return
    links = [(dep, job_id) for job_id, deps in dependents for dep in deps]
    await store.scripts.call_many(link_calls(store, tenant, links))
    await store.scripts.call_many(linked_calls(store, [job_id for job_id, _ in dependents]))


@dataclass(frozen=True, slots=True)
class PreparedFlow:
    """A flow checked and its jobs prepared (``Producer.prepare_flow``): ready to submit."""

    plan: FlowPlan
    items: list[SubmitItem]  # each job as Producer.prepare made it (ids, compensation)
    tenant: str
    idempotency_key: str  # '': none
    callbacks: tuple[CallbackSpec | None, ...] = ()  # each job's own, in the flow's order

    def __len__(self) -> int:
        return len(self.items)


def derived_ids(store: Store, prepared: PreparedFlow, head_id: str) -> list[str]:
    """The ids of a keyed flow's jobs, all derived from its head's (``plan.py``), so that a
    repeat finds the jobs the first submit made from the head alone."""
    ids = []
    for node, item in zip(prepared.plan.nodes, prepared.items, strict=True):
        if node.index == prepared.plan.head:
            ids.append(head_id)
            continue
        shard = store.keys.shard_of(item.job_id) if item.concurrency_key else None
        ids.append(derive_id(store.keys, head_id, node.index, shard))
    return ids


def planned_ids(store: Store, prepared: PreparedFlow) -> list[str]:
    """The ids the flow's jobs get if this submit creates them (a repeat answers with the
    first submit's instead)."""
    if prepared.idempotency_key:
        return derived_ids(store, prepared, prepared.items[prepared.plan.head].job_id)
    return [item.job_id for item in prepared.items]


async def submit_flow(store: Store, prepared: PreparedFlow) -> FlowSubmitted:
    """Create a prepared flow by the steps of this module's docstring."""
    plan, items, tenant = prepared.plan, prepared.items, prepared.tenant
    idempotency_key = prepared.idempotency_key
    link_ms = round(store.settings.flow_link_timeout_seconds * 1000)
    nodes = plan.nodes
    keyed = bool(idempotency_key)

    def with_ids(ids: list[str]) -> list[SubmitItem]:
        out = []
        for node, item in zip(nodes, items, strict=True):
            blob = flow_blob(
                compensation=item.compensation,
                deps=[ids[j] for j in node.after] + node.depends_on,
                children=len(node.after),
                dependents=[ids[j] for j in node.dependents],
                run_on_failure=node.spec.on_dependency_failure == "run",
                link_ms=link_ms,
            )
            out.append(dataclasses.replace(item, job_id=ids[node.index], flow=blob))
        return out

    outcomes: list[SubmitOutcome | None] = [None] * len(nodes)
    created = True
    if keyed:
        ready = with_ids(derived_ids(store, prepared, items[plan.head].job_id))
        head = dataclasses.replace(
            ready[plan.head], idempotency_key=idempotency_key, request_hash=plan.request_hash
        )
        (first,) = await submit_items(store, [head])
        if first.code is Code.IDEMPOTENCY_CONFLICT:
            raise IdempotencyConflict(idempotency_key, first.job_id)
        if first.code is Code.DUPLICATE:
            created = False
            ids = derived_ids(store, prepared, first.job_id)
            done = await store.redis.hget(store.keys.job(first.job_id), "fd")
            if done is not None:  # the earlier submit finished: the jobs as they are now
                # its writes may still be on their masters alone (a durable submit whose
                # first answer was a 503): WAIT on every node holding them, not only the head's
                await store.scripts.confirm(sorted({store.keys.shard_of(i) for i in ids}))
                return await _as_they_are(store, ids)
            ready = with_ids(ids)
        outcomes[plan.head] = first
    else:
        ready = with_ids([item.job_id for item in items])
    waiting, free = plan.rounds(head_apart=keyed)

    async def create(indices: list[int], links: Sequence[Call] = ()) -> None:
        calls, groups = submit_calls(store, [ready[i] for i in indices], SUBMIT_CHUNK)
        replies = await store.scripts.call_many([*calls, *links])
        made = in_order(len(indices), groups, replies[: len(calls)])
        for i, outcome in zip(indices, made, strict=True):
            outcomes[i] = outcome

    if waiting:  # step 2
        await create(waiting)
    # step 3: the jobs that wait for none, and the links to existing jobs
    links = [(dep, ready[n.index].job_id) for n in nodes for dep in n.depends_on]
    await create(free, link_calls(store, tenant, links))
    # step 4
    dependents = [ready[n.index].job_id for n in nodes if n.waits]
    head_id = ready[plan.head].job_id if keyed else ""
    if dependents or head_id:
        await store.scripts.call_many(linked_calls(store, dependents, head_id))
    jobs = []
    for found in outcomes:
        assert found is not None
        jobs.append(Submitted(found.job_id, bytes(found.doc), found.code is Code.OK))
    return FlowSubmitted(jobs, created)


async def _as_they_are(store: Store, ids: Sequence[str]) -> FlowSubmitted:
    docs = await read_docs(store.redis, store.keys, ids)
    jobs = [Submitted(i, bytes(doc or b""), False) for i, (_, doc) in zip(ids, docs, strict=True)]
    return FlowSubmitted(jobs, False)
