"""free_port never hands out a port twice in a row of calls, even when the kernel offers it
again (it may, once the probe's socket is closed): a run's Redis and Postgres were once given
the same port."""

from __future__ import annotations

import socket
from collections import deque
from typing import Any

import pytest

from jobtier.dev import local_redis
from jobtier.dev.local_redis import free_port


def test_a_port_the_kernel_offers_again_is_not_handed_out_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    offered = iter([40001, 40001, 40001, 40002])

    class Probe(socket.socket):
        def getsockname(self) -> Any:
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(socket, "socket", Probe)
    monkeypatch.setattr(
        local_redis, "_GIVEN", deque(maxlen=1024), raising=False
    )  # (none handed out yet)
    assert [free_port(), free_port()] == [40001, 40002]


def test_many_calls_hand_out_distinct_ports() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
