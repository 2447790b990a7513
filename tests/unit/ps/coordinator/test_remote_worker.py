"""RemoteWorker: the chief's connection to one worker task, over real gRPC (no coordinator)."""

from __future__ import annotations

import pytest

from phalanx.ps.coordinator.chief import Chief
from phalanx.ps.coordinator.closure import Closure
from phalanx.ps.coordinator.remote_worker import RemoteWorker, WorkerLostError
from phalanx.ps.transport import RpcClient
from phalanx.security.token import cluster_token


def _payload(chief, fn):
    return chief.pickle_closure(Closure(fn, (), {}))


def test_a_function_runs_and_its_value_or_its_error_comes_back(ps_2workers_1ps):
    chief = Chief.of(ps_2workers_1ps.strategy())
    worker = chief.connect_workers()[0]
    ok, data, changes = worker.run(_payload(chief, lambda: 1 + 1))
    assert ok
    assert not changes.handles
    assert RemoteWorker.result(ok, data) == 2
    ok, data, changes = worker.run(_payload(chief, lambda: 1 / 0))
    assert not ok
    assert not changes.handles
    with pytest.raises(ZeroDivisionError, match="raised on worker 0"):
        RemoteWorker.result(ok, data)  # the worker's traceback comes as a note
    worker.close()


def test_a_stopped_worker_is_lost_and_does_not_come_back(ps_2workers_1ps):
    cluster = ps_2workers_1ps
    chief = Chief.of(cluster.strategy())
    address = cluster.spec["worker"][1]
    worker = RemoteWorker(1, RpcClient(address, cluster_token(), name=f"worker:1 ({address})"), 0.1, 2)
    assert worker.ping(5.0)
    cluster.servers[("worker", 1)].stop()
    assert not worker.ping(0.2)
    assert not worker.wait_until_back(0.3)
    with pytest.raises(WorkerLostError, match=r"worker:1 \(127\.0\.0\.1:\d+\)"):
        worker.run(_payload(chief, lambda: 1))
    worker.close()
