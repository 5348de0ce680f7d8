"""The local cluster of the tests (dev/local_replicas.py) leaves no server running when it
fails to start, and stops every node even when stopping one fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobtier.dev.local_replicas import LocalCluster


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
