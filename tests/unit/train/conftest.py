"""A TF1-style cluster in this process: ps and worker servers on 127.0.0.1, no chief task."""

from __future__ import annotations

import pytest

from phalanx.cluster._ports import free_ports
from phalanx.security.token import TOKEN_ENV
from phalanx.server import Server


class TF1Cluster:
    """``{"worker": [...], "ps": [...]}`` with every task served; the test process is the client
    or plays the workers' training loops."""

    def __init__(self, workers: int, ps: int) -> None:
        ports = iter(free_ports(workers + ps))
        self.spec = {
            "worker": [f"127.0.0.1:{next(ports)}" for _ in range(workers)],
            "ps": [f"127.0.0.1:{next(ports)}" for _ in range(ps)],
        }
        self.servers = {
            (job, i): Server(self.spec, job, i) for job in self.spec for i in range(len(self.spec[job]))
        }
        self.closing: list = []

    def close(self) -> None:
        for thing in self.closing:
            thing.close()
        for server in self.servers.values():
            server.stop()


@pytest.fixture
def tf1_cluster(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "test-secret-0123456789")
    cluster = TF1Cluster(workers=2, ps=2)
    yield cluster
    cluster.close()
