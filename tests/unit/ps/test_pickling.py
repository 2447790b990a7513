"""phalanx.ps.pickling: both halves of the by-reference contract, the chief's `Chief` pickling
a closure and a worker's `WorkerEnvironment` running it over real ps tasks (no coordinator
threads)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from phalanx.coordinator import ClusterCoordinator, OutOfRangeError, PerWorkerValues
from phalanx.input.per_worker import PerWorkerDataset
from phalanx.ps.coordinator.chief import Chief
from phalanx.ps.coordinator.closure import Closure
from phalanx.ps.coordinator.remote_worker import RemoteWorker
from phalanx.ps.pickling import dumps, dumps_exception
from phalanx.ps.pickling import variable_on_worker as _worker_variable
from phalanx.ps.transport import RpcClient
from phalanx.ps.variables import PSClient, VariableHandle
from phalanx.ps.worker.environment import WorkerEnvironment
from phalanx.security.token import cluster_token
from phalanx.strategies.parameter_server_worker import WorkerStrategy


def _worker(cluster, index=1):
    """A worker's environment over the cluster's ps tasks (worker ``index`` of 2)."""
    clients = [RpcClient(a, cluster_token(), name=f"ps:{i} ({a})") for i, a in enumerate(cluster.spec["ps"])]
    return WorkerEnvironment(
        PSClient(clients), worker_index=index, num_workers=2, make_strategy=WorkerStrategy
    )


def _run(chief, env, fn, *args):
    """``fn(*args)`` sent as a scheduled function is: its value, or raises its error; its
    buffer changes reach the ps tasks as the coordinator adds them."""
    ok, data, changes = env.run(chief.pickle_closure(Closure(fn, args, {})))
    value = RemoteWorker.result(ok, data)
    chief.take_buffers(changes)
    return value


def test_a_variable_travels_by_reference_and_the_worker_reads_the_ps_value(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    chief = Chief.of(strategy)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.fill_(2.0)
    chief.before_schedule()  # the ps task holds 2.0
    with torch.no_grad():
        layer.weight.fill_(5.0)  # only the chief's copy: not sent by value
    env = _worker(ps_2workers_1ps)
    assert _run(chief, env, lambda w: float(w.detach().sum()), layer.weight) == 4.0
    handle = chief.handle_of(layer.weight)
    assert env.handles[handle.name] == handle
    assert env.variables[handle.name] is not layer.weight


def test_the_strategy_becomes_the_workers_strategy(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    env = _worker(ps_2workers_1ps)
    result = _run(Chief.of(strategy), env, lambda: (type(strategy).__name__, strategy.worker_index))
    assert result == ("WorkerStrategy", 1)


def test_per_worker_values_become_the_value_of_the_worker_that_runs(ps_2workers_1ps):
    chief, env = Chief.of(ps_2workers_1ps.strategy()), _worker(ps_2workers_1ps)
    assert _run(chief, env, lambda v: v, PerWorkerValues(("zero", "one"))) == "one"
    with pytest.raises(ValueError, match=r"one value per worker \(2\)\. Received: 3"):
        _run(chief, env, lambda v: v, PerWorkerValues(("a", "b", "c")))


def test_a_per_worker_iterator_becomes_the_workers_own_made_once(ps_2workers_1ps):
    chief, env = Chief.of(ps_2workers_1ps.strategy()), _worker(ps_2workers_1ps)
    iterator = iter(PerWorkerDataset(lambda ctx: [10 * ctx.input_pipeline_id + k for k in range(2)], dumps))
    assert [_run(chief, env, next, iterator) for _ in range(2)] == [10, 11]
    with pytest.raises(OutOfRangeError, match="worker 1 is exhausted"):
        _run(chief, env, next, iterator)


def test_a_closure_that_uses_the_coordinator_is_refused(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with pytest.raises(TypeError, match="exists on the chief only"):
        Chief.of(strategy).pickle_closure(Closure(lambda: coordinator.done(), (), {}))


def test_an_optimizer_is_adopted_and_its_state_must_belong_to_variables_of_the_scope(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    chief = Chief.of(strategy)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert not chief.optimizers.adopted(optimizer)
    chief.pickle_closure(Closure(lambda: optimizer, (), {}))
    assert chief.optimizers.adopted(optimizer)
    outside = torch.nn.Parameter(torch.ones(3))
    stranger = torch.optim.SGD([outside], lr=0.1, momentum=0.9)
    stranger.state[outside] = {"momentum_buffer": torch.zeros(3)}  # state to move: a loaded checkpoint
    with pytest.raises(ValueError, match=r"not created in strategy.scope\(\) \(shape \(3,\)\)\. HINT"):
        chief.pickle_closure(Closure(lambda: stranger, (), {}))


def test_an_exception_that_cannot_be_pickled_comes_back_as_a_runtime_error():
    class Unpicklable(Exception):
        def __init__(self) -> None:
            super().__init__("holds a lock")
            self.lock = threading.Lock()

    error = pickle.loads(dumps_exception(Unpicklable()))
    assert type(error) is RuntimeError
    assert str(error) == "Unpicklable: holds a lock"


def test_a_variable_unpickled_outside_a_worker_is_an_error():
    data = pickle.dumps(_worker_variable)
    handle = VariableHandle("0/Linear.weight", 0, (2, 2), "torch.float32")
    with pytest.raises(RuntimeError, match="outside a worker"):
        pickle.loads(data)(handle)
