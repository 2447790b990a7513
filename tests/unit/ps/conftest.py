"""An in-process parameter-server cluster: real gRPC servers on 127.0.0.1 in this process."""

from __future__ import annotations

import pytest

from phalanx.cluster._ports import free_ports
from phalanx.cluster.resolvers import SimpleClusterResolver
from phalanx.security.token import TOKEN_ENV
from phalanx.server import Server


class Cluster:
    def __init__(self, workers: int, ps: int) -> None:
        ports = iter(free_ports(1 + workers + ps))
        self.spec = {
            "chief": [f"127.0.0.1:{next(ports)}"],
            "worker": [f"127.0.0.1:{next(ports)}" for _ in range(workers)],
            "ps": [f"127.0.0.1:{next(ports)}" for _ in range(ps)],
        }
        self.servers = {
            (job, i): Server(self.spec, job, i)
            for job in ("ps", "worker")
            for i in range(len(self.spec[job]))
        }
        self.strategies: list = []

    def resolver(self) -> SimpleClusterResolver:
        return SimpleClusterResolver(self.spec, task_type="chief", task_id=0)

    def strategy(self, partitioner=None):
        import phalanx

        strategy = phalanx.ParameterServerStrategy(
            self.resolver(), variable_partitioner=partitioner, connect_timeout=10
        )
        self.strategies.append(strategy)
        return strategy

    def close(self) -> None:
        for strategy in self.strategies:
            strategy.close()
        for server in self.servers.values():
            server.stop()


@pytest.fixture
def ps_2workers_1ps(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "test-secret-0123456789")
    cluster = Cluster(workers=2, ps=1)
    yield cluster
    cluster.close()


@pytest.fixture
def ps_1worker_2ps(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "test-secret-0123456789")
    cluster = Cluster(workers=1, ps=2)
    yield cluster
    cluster.close()
