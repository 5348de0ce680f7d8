"""``Client`` and ``AsyncClient`` mirror each other exactly: the same public methods, each with
the same parameters, defaults and documentation, one awaited and one not."""

from __future__ import annotations

import inspect

from jobtier.client import AsyncClient, Client


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_the_two_clients_have_the_same_methods_and_parameters() -> None:
    sync, asynchronous = public_methods(Client), public_methods(AsyncClient)
    assert sorted(sync) == sorted(asynchronous)
    for name, signature in sync.items():
        other = asynchronous[name]
        assert list(signature.parameters) == list(other.parameters), name
        for param, value in signature.parameters.items():
            mirrored = other.parameters[param]
            assert (value.kind, value.default) == (mirrored.kind, mirrored.default), (name, param)
    # the new operations are there on both
    for name in (
        "list_jobs", "show", "history", "logs", "retry",
        "dead_letters", "dead_letter", "replay", "replay_dead_letters",
    ):  # fmt: skip
        assert name in sync and inspect.iscoroutinefunction(getattr(AsyncClient, name)), name
