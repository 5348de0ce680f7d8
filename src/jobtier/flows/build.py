"""Building flows: chains and fan-ins, nested as deep as you like.

A flow is a list of ``FlowJob``; its *end* is its last job (what a chain step or a parent
waits for). Both builders take jobs or whole flows and give a flow, so they nest::

    from jobtier.flows import chain, fan_in
    from jobtier.core.model import FlowJob

    report = fan_in(
        FlowJob(type="merge"),                       # runs last, with every child's result
        [FlowJob(type="fetch", payload={"page": p}) for p in range(10)],
    )
    pipeline = chain(FlowJob(type="extract"), FlowJob(type="clean"), report)
    await queue.submit_flow(pipeline)                # or client.submit_flow(pipeline)

A job without a ``ref`` gets one (``_1``, ``_2``, …); refs must be unique in the flow.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

import msgspec

from jobtier.core.model import FlowJob, JobSpec

Step = FlowJob | JobSpec | Sequence[FlowJob]


def _flow(step: Step) -> list[FlowJob]:
    if isinstance(step, FlowJob):
        return [step]
    if isinstance(step, JobSpec):
        if step.idempotency_key is not None:
            raise ValueError("a job of a flow has no idempotency key: give one to the flow")
        fields = msgspec.structs.asdict(step)
        del fields["idempotency_key"]
        # what a flow's job does not take (a key's options, an expiry): refused if given
        extra = [k for k, v in fields.items() if k not in FlowJob.__struct_fields__]
        given = [k for k in extra if fields[k] is not None]
        if given:
            raise ValueError(f"a job of a flow takes no {', '.join(given)}")
        return [FlowJob(**{k: v for k, v in fields.items() if k not in extra})]
    jobs = list(step)
    if not jobs or not all(isinstance(j, FlowJob) for j in jobs):
        raise ValueError("a step is a FlowJob, a JobSpec or a non-empty list of FlowJobs")
    return jobs


GENERATED = re.compile(r"^_[0-9]+$")  # the refs the builders give (renumbered when nested)


def _named(flows: Sequence[list[FlowJob]]) -> list[list[FlowJob]]:
    """The flows with a ref on every job, unique across them all: a job without one gets
    one, and the refs builders gave (``_<n>``) are given again, so flows built apart can be
    combined; the refs you chose must be unique."""
    taken: set[str] = set()
    for flow in flows:
        for job in flow:
            if job.ref is not None and not GENERATED.fullmatch(job.ref):
                if job.ref in taken:
                    raise ValueError(f"ref {job.ref!r} is used twice")
                taken.add(job.ref)
    counter = itertools.count(1)

    def fresh() -> str:
        while True:
            ref = f"_{next(counter)}"
            if ref not in taken:
                taken.add(ref)
                return ref

    out = []
    for flow in flows:
        refs = [fresh() if j.ref is None or GENERATED.fullmatch(j.ref) else j.ref for j in flow]
        renamed = {j.ref: ref for j, ref in zip(flow, refs, strict=True) if j.ref is not None}
        out.append(
            [
                msgspec.structs.replace(
                    job,
                    ref=ref,
                    after=[renamed.get(r, r) for r in job.after] if job.after else job.after,
                )
                for job, ref in zip(flow, refs, strict=True)
            ]
        )
    return out


def _waits_for(job: FlowJob, refs: Sequence[str]) -> FlowJob:
    return msgspec.structs.replace(job, after=[*(job.after or ()), *refs])


def chain(*steps: Step) -> list[FlowJob]:
    """Each step waits for the one before it (for the end of a step that is a flow), and its
    task finds that one's result in ``ctx.previous``."""
    if not steps:
        raise ValueError("a chain needs at least one step")
    flows = _named([_flow(step) for step in steps])
    out = list(flows[0])
    for flow in flows[1:]:
        end = out[-1].ref
        assert end is not None
        # the step's first jobs (those that wait for nothing in it) wait for the previous end
        inside = {j.ref for j in flow}
        out.extend(_waits_for(j, [end]) if not set(j.after or ()) & inside else j for j in flow)
    return out


def fan_in(parent: Step, children: Sequence[Step]) -> list[FlowJob]:
    """``parent`` (its end, for a flow) waits for every child (the end of each child that is
    a flow) and finds their results in ``ctx.dependencies``; cancelling it cancels those that
    have not started. The result ends with the parent."""
    if not children:
        raise ValueError("a fan-in needs at least one child")
    flows = _named([_flow(parent), *(_flow(c) for c in children)])
    head, kids = flows[0], flows[1:]
    ends = [flow[-1].ref for flow in kids]
    out = [job for flow in kids for job in flow]
    out.extend(head[:-1])
    out.append(_waits_for(head[-1], [e for e in ends if e is not None]))
    return out
