"""The local cluster of the tests (dev/local_replicas.py) leaves no server running when it
fails to start, stops every node even when stopping one fails, and chooses a node's ports
again when something took them before it started."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest
import redis as syncredis

from jobtier.dev.local_redis import CLUSTER_BUS_OFFSET, LocalRedis, PortTaken
from jobtier.dev.local_replicas import LocalCluster, TlsFiles


def test_a_cluster_that_fails_to_start_stops_the_nodes_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = LocalCluster(tmp_path, masters=3)
    first, second, _ = cluster.nodes

    def broken() -> None:
        raise RuntimeError("this node does not start")

    monkeypatch.setattr(second, "start", broken)
    try:
        with pytest.raises(RuntimeError, match="does not start"):
            cluster.start()
        assert first.pid is None and first.proc is None  # started, then stopped
    finally:
        cluster.stop()


def test_stop_stops_every_node_when_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = LocalCluster(tmp_path, masters=2)
    first, second = cluster.nodes
    try:
        first.start()
        second.start()
        assert second.pid is not None
        real_stop = first.stop

        def broken(*_: object) -> None:
            real_stop()
            raise RuntimeError("this node does not stop")

        monkeypatch.setattr(first, "stop", broken)
        with pytest.raises(RuntimeError, match="does not stop"):
            cluster.stop()
        assert second.pid is None and second.proc is None  # stopped all the same
    finally:
        monkeypatch.undo()
        cluster.stop()


def _taken(port: int) -> socket.socket:
    """A socket bound to ``port`` on loopback, as something that took it after it was chosen
    (bound, not listening: nothing answers there in the server's stead)."""
    taker = socket.socket()
    taker.bind(("127.0.0.1", port))
    return taker


def test_a_server_whose_port_was_taken_says_so_from_its_log(tmp_path: Path) -> None:
    server = LocalRedis(tmp_path / "redis")
    with _taken(server.port), pytest.raises(PortTaken, match=f"{server.port}.*already in use"):
        server.start()
    assert server.proc is None


def test_a_cluster_whose_ports_were_taken_before_it_started_chooses_others(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """Ports chosen free may be taken by the time a node starts (the tests' TLS cluster once
    failed so): its plain port, its TLS port, its TLS port's cluster bus."""
    cluster = LocalCluster(tmp_path, masters=3, tls=tls_files)
    first, second, third = cluster.nodes
    before = [first.port, int(second.options["tls-port"]), int(third.options["tls-port"])]
    with contextlib.ExitStack() as held:
        for port in (before[0], before[1], before[2] + CLUSTER_BUS_OFFSET):
            held.enter_context(_taken(port))
        try:
            cluster.start()
            assert first.port != before[0]
            assert cluster.tls_ports[1] != before[1] and cluster.tls_ports[2] != before[2]
            with syncredis.Redis(port=first.port) as client:  # a plain port: told plain ones
                # [[first slot, last slot, [host, port, id]], ...]
                slots = client.execute_command("CLUSTER", "SLOTS")
            masters = {int(primary[1]) for _, _, primary, *_ in slots}
            assert masters == {node.port for node in cluster.nodes}, masters
        finally:
            cluster.stop()
