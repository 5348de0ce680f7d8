"""A flow checked and laid out before anything is sent: refs, cycles, sizes, ids, order.

Pure functions (no I/O): a bad flow raises ``InvalidRequest`` naming the job and member
(``jobs[3].after``) and changes nothing.

Creation order (``FlowPlan.rounds``) makes a flow safe to cut short: every job that waits
for others is created before any job it waits for can finish. Jobs with dependencies go
first; the jobs without any go next, each created knowing its dependents (``lib.lua
flow_create``), so however fast one finishes, its dependents exist to be told. With an
idempotency key the flow's head (the job its idempotency record names) is created alone
first: if the head is not there, nothing of the flow is. Every other job's id then derives
from the head's (``derive_id``), so a repeat that finds the head makes the same ids, and
finishing a cut-short submit creates exactly the jobs that are missing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import Keys
from jobtier.core.model import FlowJob, JobSpec
from jobtier.core.names import REF_RE


@dataclass(slots=True)
class Node:
    """One job of the flow: its spec, the jobs of the flow it waits for (its children, by
    index), the existing jobs it waits for (ids), and the jobs of the flow that wait for it."""

    index: int
    spec: JobSpec
    after: list[int] = field(default_factory=list)
    depends_on: list[str] = field(default_factory=list)
    dependents: list[int] = field(default_factory=list)

    @property
    def waits(self) -> bool:
        return bool(self.after or self.depends_on)


@dataclass(slots=True)
class FlowPlan:
    nodes: list[Node]
    head: int  # the job created first: the first that waits for others (else the first)
    request_hash: str  # identifies "the same flow" for its idempotency key

    def rounds(self, head_apart: bool) -> tuple[list[int], list[int]]:
        """(jobs that wait for others, jobs that wait for none), in creation order; the head
        left out of both when it is created apart (the flow has an idempotency key)."""
        skip = self.head if head_apart else -1
        waiting = [n.index for n in self.nodes if n.waits and n.index != skip]
        ready = [n.index for n in self.nodes if not n.waits and n.index != skip]
        return waiting, ready

    @property
    def external(self) -> list[str]:
        """Every existing job some job of the flow waits for."""
        return list(dict.fromkeys(d for n in self.nodes for d in n.depends_on))


def _bad(index: int, member: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"jobs[{index}]: {message}", field=f"jobs[{index}].{member}")


def plan_flow(jobs: Sequence[FlowJob], keys: Keys, max_jobs: int) -> FlowPlan:
    """Check a flow's shape: size, refs, ``after`` and ``depends_on`` (well-formed ids), no
    cycle. Ids named in ``depends_on`` are checked against Redis later."""
    if not jobs:
        raise InvalidRequest("a flow needs at least one job", field="jobs")
    if len(jobs) > max_jobs:
        raise InvalidRequest(
            f"a flow holds at most {max_jobs} jobs (JOBTIER_MAX_FLOW_JOBS); this one has "
            f"{len(jobs)}",
            field="jobs",
        )
    by_ref: dict[str, int] = {}
    for i, job in enumerate(jobs):
        if job.ref is None:
            continue
        if not isinstance(job.ref, str) or not REF_RE.fullmatch(job.ref):
            raise _bad(i, "ref", f"ref must match {REF_RE.pattern}")
        if job.ref in by_ref:
            raise _bad(i, "ref", f"ref {job.ref!r} is also jobs[{by_ref[job.ref]}]'s")
        by_ref[job.ref] = i
    nodes = [Node(i, job.spec()) for i, job in enumerate(jobs)]
    for i, job in enumerate(jobs):
        node = nodes[i]
        for ref in dict.fromkeys(job.after or ()):
            j = by_ref.get(ref) if isinstance(ref, str) else None
            if j is None:
                message = f"after names {str(ref)[:70]!r}, which no job of the flow has as its ref"
                raise _bad(i, "after", message)
            if j == i:
                raise _bad(i, "after", "a job cannot wait for itself")
            node.after.append(j)
            nodes[j].dependents.append(i)
        for dep in dict.fromkeys(job.depends_on or ()):
            if not isinstance(dep, str) or not keys.valid_id(dep):
                message = f"depends_on names {str(dep)[:70]!r}, which is not a job id"
                raise _bad(i, "depends_on", message)
            node.depends_on.append(dep)
        if len(node.after) + len(node.depends_on) > max_jobs:
            message = f"a job waits for at most {max_jobs} others (JOBTIER_MAX_FLOW_JOBS)"
            raise _bad(i, "after", message)
    cycle = find_cycle(nodes)
    if cycle:
        names = " -> ".join(
            f"jobs[{i}]" + (f" ({jobs[i].ref})" if jobs[i].ref else "") for i in cycle
        )
        raise InvalidRequest(f"the flow has a cycle: {names}", field=f"jobs[{cycle[0]}].after")
    head = next((n.index for n in nodes if n.waits), 0)
    # "the same flow" is the same jobs, whatever their callbacks (a repeat answers with the
    # first submit's jobs, which keep theirs); dropped, not nulled, to keep older hashes
    hashed = [_without_callback(job) for job in jobs]
    digest = hashlib.blake2b(msgspec.json.encode(hashed), digest_size=16).hexdigest()
    return FlowPlan(nodes, head, "flow:" + digest)


def _without_callback(job: FlowJob) -> dict[str, Any]:
    fields = msgspec.structs.asdict(job)
    del fields["callback"]
    return fields


def find_cycle(nodes: Sequence[Node]) -> list[int]:
    """A cycle of ``after`` links as the indices on it (first repeated last), or []."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = [WHITE] * len(nodes)
    for start in range(len(nodes)):
        if colour[start] != WHITE:
            continue
        # iterative depth-first search: a long chain must not hit the recursion limit
        path: list[int] = []
        stack: list[tuple[int, int]] = [(start, 0)]
        colour[start] = GREY
        path.append(start)
        while stack:
            i, k = stack[-1]
            after = nodes[i].after
            if k < len(after):
                stack[-1] = (i, k + 1)
                j = after[k]
                if colour[j] == GREY:
                    return [*path[path.index(j) :], j]
                if colour[j] == WHITE:
                    colour[j] = GREY
                    path.append(j)
                    stack.append((j, 0))
            else:
                colour[i] = BLACK
                path.pop()
                stack.pop()
    return []


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def derive_id(keys: Keys, head_id: str, index: int, shard: int | None) -> str:
    """The id of job ``index`` of the flow whose head is ``head_id``: the head's time, 80 bits
    of a hash of (head, index), in ``shard`` (or one the hash picks)."""
    digest = hashlib.blake2b(f"{head_id}\x00{index}".encode(), digest_size=12).digest()
    if shard is None:
        shard = int.from_bytes(digest[10:], "big") % keys.shards
    entropy = int.from_bytes(digest[:10], "big")
    tail = []
    for _ in range(16):
        tail.append(_CROCKFORD[entropy & 31])
        entropy >>= 5
    return f"{head_id[:10]}{''.join(reversed(tail))}-{shard}"
