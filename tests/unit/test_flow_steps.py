"""``chain`` and ``fan_in`` take a ``JobSpec`` as a step (flows/build.py): its fields a flow's
job has are kept; a key's options or an expiry, which a flow's job does not take, are refused
by name (a JobSpec with none of them set made a TypeError: unexpected keyword 'debounce')."""

from __future__ import annotations

import pytest

from jobtier.core.debounce import Unique
from jobtier.core.model import JobSpec
from jobtier.flows import chain


def test_a_jobspec_is_a_step() -> None:
    jobs = chain(JobSpec(type="fetch", payload=1, queue="io"), JobSpec(type="merge"))
    assert [(j.type, j.payload, j.queue) for j in jobs] == [
        ("fetch", 1, "io"),
        ("merge", None, None),
    ]
    assert jobs[1].after == [jobs[0].ref]


@pytest.mark.parametrize(
    ("options", "named"),
    [({"expires_in": 60.0}, "expires_in"), ({"unique": Unique(key="k")}, "unique")],
)
def test_what_a_flows_job_does_not_take_is_refused_by_name(
    options: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=f"a job of a flow takes no {named}"):
        chain(JobSpec(type="fetch", **options), JobSpec(type="merge"))  # type: ignore[arg-type]
