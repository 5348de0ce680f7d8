"""The public API is what ``jobtier`` and ``jobtier.client`` export; nothing else is promised."""

from __future__ import annotations

import jobtier
import jobtier.client


def test_exports_resolve_and_are_sorted() -> None:
    for module in (jobtier, jobtier.client):
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert getattr(module, name) is not None, name


def test_the_pieces_a_user_needs_are_there() -> None:
    for name in ("Queue", "Worker", "Scheduler", "task", "JobContext", "Client", "AsyncClient",
                 "Settings", "JobStatus", "State", "Retry", "Fatal", "ScheduleSpec"):  # fmt: skip
        assert name in jobtier.__all__, name
