"""ParameterServerStrategy and ClusterCoordinator on an in-process cluster (real gRPC)."""

from __future__ import annotations

import time

import pytest
import torch

import phalanx
from phalanx.cluster.resolvers import SimpleClusterResolver
from phalanx.coordinator import (
    ClosureAbortedError,
    ClusterCoordinator,
    NoWorkerAvailableError,
    OutOfRangeError,
    PerWorkerValues,
)
from phalanx.ps.transport import AuthenticationError, TaskUnavailableError
from phalanx.security.token import TOKEN_ENV
from phalanx.server import Server


def _data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, 4, generator=g)
    return x, x.sum(-1, keepdim=True)


def _mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _train_locally(model, optimizer, xs, ys):
    for x, y in zip(xs, ys, strict=True):
        _mse_step(model, optimizer, x, y)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=0.01),
    ],
    ids=["sgd-momentum", "adam"],
)
def test_one_worker_stepping_in_turn_equals_local_training(ps_1worker_2ps, make_optimizer):
    xs, ys = _data()
    local = _model()
    local_opt = make_optimizer(local.parameters())
    _train_locally(local, local_opt, xs, ys)

    strategy = ps_1worker_2ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = _model()
        optimizer = make_optimizer(model.parameters())

    def step(x, y):
        def replica_fn(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss.detach()

        return strategy.run(replica_fn, args=(x, y))

    for x, y in zip(xs, ys, strict=True):
        coordinator.schedule(step, args=(x, y))
        coordinator.join()
    for ours, theirs in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # the optimizer's state lives on the ps tasks; the coordinator's state_dict reads it
    saved = optimizer.state_dict()
    expected = local_opt.state_dict()
    assert saved["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(saved["state"][index][key], value, rtol=1e-5, atol=1e-6)


def test_optimizer_state_loaded_on_the_coordinator_continues_training(ps_1worker_2ps):
    xs, ys = _data()
    local = _model()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    _train_locally(local, local_opt, xs, ys)
    half = _model()
    half_opt = torch.optim.Adam(half.parameters(), lr=0.01)
    _train_locally(half, half_opt, xs[:4], ys[:4])

    strategy = ps_1worker_2ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model.load_state_dict(half.state_dict())  # a checkpoint restored before training
    optimizer.load_state_dict(half_opt.state_dict())

    def step(x, y):
        _mse_step(model, optimizer, x, y)  # optimizer.step() outside strategy.run

    for x, y in zip(xs[4:], ys[4:], strict=True):
        coordinator.schedule(step, args=(x, y))
        coordinator.join()
    for ours, theirs in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert not optimizer.state  # moved to the ps tasks


def test_variables_are_placed_round_robin(ps_1worker_2ps):
    strategy = ps_1worker_2ps.strategy()
    with strategy.scope():
        model = _model()
    assert [h.ps for _, h in strategy._live()] == [0, 1, 0, 1]
    assert len(list(model.parameters())) == 4
    assert strategy.num_ps == 2
    assert repr(strategy) == "ParameterServerStrategy(workers=1, ps=2)"


def test_functions_run_on_every_worker(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    values = [coordinator.schedule(lambda: strategy.worker_index) for _ in range(20)]
    coordinator.join()
    assert {v.fetch() for v in values} <= {0, 1}
    assert coordinator.done()
    assert coordinator.fetch({"a": [values[0]]}) == {"a": [values[0].fetch()]}


def test_a_failing_function_cancels_the_rest_and_join_raises_once(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)

    def fails():
        raise KeyError("bad step")

    failing = coordinator.schedule(fails)
    with pytest.raises(KeyError, match="bad step"):
        coordinator.join()
    with pytest.raises(KeyError):
        failing.fetch()
    assert coordinator.schedule(lambda: 3).fetch() == 3  # usable again


def test_per_worker_datasets_get_an_input_context_and_exhaustion_is_out_of_range(ps_1worker_2ps):
    strategy = ps_1worker_2ps.strategy()
    coordinator = ClusterCoordinator(strategy)

    def dataset_fn(ctx):
        return [(ctx.num_input_pipelines, ctx.input_pipeline_id, i) for i in range(2)]

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    with pytest.raises(RuntimeError, match="advanced on the workers"):
        next(iterator)
    firsts = [coordinator.schedule(next, args=(iterator,)) for _ in range(2)]
    coordinator.join()
    assert [f.fetch() for f in firsts] == [(1, 0, 0), (1, 0, 1)]
    coordinator.schedule(next, args=(iterator,))
    with pytest.raises(OutOfRangeError, match="exhausted"):
        coordinator.join()
    with pytest.raises(TypeError, match="function that returns the dataset"):
        coordinator.create_per_worker_dataset([1, 2])


def test_errors_inside_scheduled_functions(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)

    def makes_a_layer():
        with strategy.scope():
            torch.nn.Linear(2, 2)

    coordinator.schedule(makes_a_layer)
    with pytest.raises(RuntimeError, match="created by the coordinator"):
        coordinator.join()
    local = torch.nn.Linear(2, 2)
    with strategy.scope():
        model = torch.nn.Linear(2, 2)
    foreign = torch.optim.SGD([*model.parameters(), *local.parameters()], lr=0.1)
    coordinator.schedule(lambda: foreign.step())
    with pytest.raises(ValueError, match="not a variable of the parameter-server cluster"):
        coordinator.join()
    coordinator.schedule(lambda: coordinator.done())
    with pytest.raises(TypeError, match="exists on the chief only"):
        coordinator.join()


def test_coordinator_errors(ps_2workers_1ps):
    with pytest.raises(TypeError, match="ParameterServerStrategy only"):
        ClusterCoordinator(phalanx.OneDeviceStrategy("cpu"))
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    assert strategy.cluster_coordinator is coordinator
    with pytest.raises(ValueError, match="already has a ClusterCoordinator"):
        ClusterCoordinator(strategy)
    with pytest.raises(TypeError, match="needs a callable"):
        coordinator.schedule(42)
    coordinator.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        coordinator.schedule(lambda: 1)


def test_a_lost_worker_is_replaced_and_no_worker_at_all_is_an_error_naming_them(ps_2workers_1ps):
    cluster = ps_2workers_1ps
    strategy = cluster.strategy()
    coordinator = ClusterCoordinator(strategy, worker_recovery_timeout=1.0)
    cluster.servers[("worker", 1)].stop()
    values = [coordinator.schedule(lambda: strategy.worker_index) for _ in range(6)]
    coordinator.join()
    assert {v.fetch() for v in values} == {0}
    cluster.servers[("worker", 0)].stop()
    coordinator.schedule(lambda: 1)
    with pytest.raises(NoWorkerAvailableError, match="worker:0"):
        coordinator.join()
    cluster.servers[("worker", 0)] = Server(cluster.spec, "worker", 0)  # it comes back
    deadline = time.monotonic() + 30
    while 0 in coordinator._lost and time.monotonic() < deadline:  # noticed within a ping
        time.sleep(0.05)
    assert coordinator.schedule(lambda: 2).fetch(timeout=30) == 2


def test_closure_aborted_for_queued_functions_after_a_failure(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)

    def slow_fail():
        time.sleep(0.2)
        raise ValueError("first")

    coordinator.schedule(slow_fail)
    coordinator.schedule(slow_fail)
    later = [coordinator.schedule(lambda: 1) for _ in range(50)]
    with pytest.raises(ValueError, match="first"):
        coordinator.join()
    aborted = [v for v in later if v.status.value == "ABORTED"]
    assert aborted
    with pytest.raises(ClosureAbortedError, match="earlier scheduled function failed"):
        aborted[0].fetch()


def test_strategy_configuration_errors(ps_2workers_1ps, monkeypatch):
    spec = ps_2workers_1ps.spec
    with pytest.raises(TypeError, match="variable_partitioner must be callable"):
        phalanx.ParameterServerStrategy(ps_2workers_1ps.resolver(), variable_partitioner=object())
    with pytest.raises(ValueError, match=r"'ps' and 'worker' jobs.*\['ps'\] missing"):
        phalanx.ParameterServerStrategy(
            SimpleClusterResolver(
                {"chief": spec["chief"], "worker": spec["worker"]}, task_type="chief", task_id=0
            )
        )
    with pytest.raises(ValueError, match="created by the coordinator, the 'chief' task"):
        phalanx.ParameterServerStrategy(SimpleClusterResolver(spec, task_type="worker", task_id=0))
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(ValueError, match="PHALANX_CLUSTER_TOKEN is not set"):
        phalanx.ParameterServerStrategy(ps_2workers_1ps.resolver())


def test_a_wrong_token_is_refused_and_a_missing_ps_is_named(ps_2workers_1ps, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "another-secret-0123456789")
    with pytest.raises(AuthenticationError, match="same PHALANX_CLUSTER_TOKEN"):  # in the TLS handshake
        phalanx.ParameterServerStrategy(ps_2workers_1ps.resolver(), connect_timeout=10)
    ps_2workers_1ps.servers[("ps", 0)].stop()
    with pytest.raises(TaskUnavailableError, match=r"ps:0 \(127.0.0.1:\d+\) was not reachable within 0.5s"):
        phalanx.ParameterServerStrategy(ps_2workers_1ps.resolver(), connect_timeout=0.5)


def test_an_optimizer_step_on_the_coordinator_is_an_error(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()

    def step():
        optimizer.step()

    with pytest.raises(RuntimeError, match="training steps run on the workers"):
        strategy.run(step)
    with pytest.raises(RuntimeError, match="training steps run on the workers"), strategy.scope():
        optimizer.step()
    assert strategy.run(lambda: model(torch.ones(1, 2)).shape) == (1, 1)  # evaluation is fine


def test_per_worker_values_become_the_running_workers_value(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    values = PerWorkerValues(("zero", "one"))
    results = [coordinator.schedule(lambda v: (strategy.worker_index, v), args=(values,)) for _ in range(10)]
    coordinator.join()
    assert all({0: "zero", 1: "one"}[w] == v for w, v in (r.fetch() for r in results))
    assert coordinator.fetch(PerWorkerValues((results[0],))) == (results[0].fetch(),)
    coordinator.schedule(lambda v: v, args=(PerWorkerValues(("only one",)),))
    with pytest.raises(ValueError, match="one value per worker"):
        coordinator.join()


def test_model_fit_schedules_every_step_and_aggregates_every_workers_metrics(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, generator=g)
    y = (x.sum(1) > 0).long()
    with strategy.scope():
        torch.manual_seed(0)
        layers = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        model = phalanx.Model(layers)
        model.compile(
            optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
            loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(x, y, batch_size=30, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert history.history["accuracy"][-1] > 0.8
    assert int(model._loss_tracker.count) == 300  # every step's metric update reached the ps
    assert strategy.cluster_coordinator is not None
    loss, accuracy = model.evaluate(x, y, verbose=0)  # inline, on the coordinator
    assert accuracy > 0.8


@pytest.mark.parametrize(
    "make_optimizer",
    [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.Adam(p, lr=0.01)],
    ids=["sgd-momentum", "adam"],
)
def test_a_partitioned_model_trains_like_a_local_one(ps_1worker_2ps, make_optimizer):
    from phalanx.partitioners import FixedShardsPartitioner

    xs, ys = _data()
    local = _model()
    local_opt = make_optimizer(local.parameters())
    _train_locally(local, local_opt, xs, ys)
    strategy = ps_1worker_2ps.strategy(FixedShardsPartitioner(2))
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = _model()
        optimizer = make_optimizer(model.parameters())
    handles = [h for _, h in strategy._live()]
    assert [len(h.shards) for h in handles] == [2, 2, 0, 0]  # one-row variables stay whole
    assert [[s.ps for s in h.shards] for h in handles[:2]] == [[0, 1], [0, 1]]
    assert [s.shape for s in handles[0].shards] == [(4, 4), (4, 4)]

    def step(x, y):
        _mse_step(model, optimizer, x, y)

    for x, y in zip(xs, ys, strict=True):
        coordinator.schedule(step, args=(x, y))
        coordinator.join()
    for ours, theirs in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    saved = optimizer.state_dict()["state"]
    for index, entry in local_opt.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(saved[index][key], value, rtol=1e-5, atol=1e-6)


def test_a_sharded_sparse_embedding_with_restored_optimizer_state_trains_like_a_local_one(ps_1worker_2ps):
    from phalanx.partitioners import FixedShardsPartitioner

    ids = torch.randint(0, 10, (6, 5), generator=torch.Generator().manual_seed(1))

    def make():
        torch.manual_seed(0)
        return torch.nn.Embedding(10, 3, sparse=True)

    def train(module, opt, batches):
        for batch in batches:
            opt.zero_grad()
            module(batch).pow(2).sum().backward()
            opt.step()

    local = make()
    local_opt = torch.optim.Adagrad(local.parameters(), lr=0.1)
    train(local, local_opt, ids)
    half = make()
    half_opt = torch.optim.Adagrad(half.parameters(), lr=0.1)
    train(half, half_opt, ids[:3])

    strategy = ps_1worker_2ps.strategy(FixedShardsPartitioner(3))
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        embedding = make()
        optimizer = torch.optim.Adagrad(embedding.parameters(), lr=0.1)
    (handle,) = [h for _, h in strategy._live()]
    assert [s.shape for s in handle.shards] == [(4, 3), (3, 3), (3, 3)]
    assert [s.ps for s in handle.shards] == [0, 1, 0]
    embedding.load_state_dict(half.state_dict())
    optimizer.load_state_dict(half_opt.state_dict())  # split over the shards on the next schedule
    for batch in ids[3:]:
        coordinator.schedule(train, args=(embedding, optimizer, [batch]))
        coordinator.join()
    torch.testing.assert_close(embedding.weight, local.weight, rtol=1e-5, atol=1e-6)
    ours, theirs = optimizer.state_dict()["state"][0]["sum"], local_opt.state_dict()["state"][0]["sum"]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("make_optimizer", "sparse"),
    [
        (lambda p: torch.optim.Adam(p, lr=0.05), False),
        (lambda p: torch.optim.Adagrad(p, lr=0.1), True),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
    ],
    ids=["adam", "adagrad", "sgd-momentum"],
)
@pytest.mark.parametrize("shards", [2, 1], ids=["split", "whole"])
def test_an_embedding_is_read_by_rows_split_or_not_and_trains_like_a_local_one(
    ps_1worker_2ps, make_optimizer, sparse, shards
):
    from phalanx.partitioners import FixedShardsPartitioner
    from phalanx.ps.variables import PSClient

    ids = torch.randint(0, 50, (5, 2, 4), generator=torch.Generator().manual_seed(2))
    ids[0, 0, 0] = 0  # the padding row

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Embedding(50, 4, padding_idx=0, sparse=sparse), torch.nn.Linear(4, 1)
        )

    def train(model, opt, batches):
        for batch in batches:
            opt.zero_grad()
            model(batch).pow(2).mean().backward()
            opt.step()

    local = make()
    local_opt = make_optimizer(local.parameters())
    train(local, local_opt, ids)
    strategy = ps_1worker_2ps.strategy(FixedShardsPartitioner(shards))
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = make()
        optimizer = make_optimizer(model.parameters())
    table = strategy._live()[0][1]
    assert (table.kind, len(table.shards)) == ("embedding", 0 if shards == 1 else shards)
    rows_read, dense_read = [], []
    original, original_dense = PSClient.read_changed_and_rows, PSClient.read_changed

    def counting(self, handles, known, table, rows):
        rows_read.append(rows.numel())
        return original(self, handles, known, table, rows)

    def counting_dense(self, handles, known):
        dense_read.append(len(handles))
        return original_dense(self, handles, known)

    whole_table_lookups = []
    original_embedding = torch.nn.functional.embedding

    def counting_embedding(ids, weight, *args, **kwargs):
        if weight.shape[0] == 50 and ids.numel():  # the module's own lookup in the whole table
            whole_table_lookups.append(ids.numel())
        return original_embedding(ids, weight, *args, **kwargs)

    PSClient.read_changed_and_rows, PSClient.read_changed = counting, counting_dense
    torch.nn.functional.embedding = counting_embedding
    try:
        for batch in ids:
            coordinator.schedule(train, args=(model, optimizer, [batch]))
            coordinator.join()
    finally:
        PSClient.read_changed_and_rows, PSClient.read_changed = original, original_dense
        torch.nn.functional.embedding = original_embedding
    for ours, theirs in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert rows_read  # the worker looked rows up (in-process, the same class)
    assert max(rows_read) <= 8  # never the whole table of 50
    assert len(rows_read) == len(ids)  # one lookup per step ...
    assert dense_read == []  # ... which read the Linear layer too: one read round trip per step
    assert whole_table_lookups == []  # the module's forward got no ids: its result was thrown away


def _one_sgd_step_on_two_sharded_ps(cluster, make):
    """(the model after one SGD step scheduled on a worker, tables split over 2 ps; the same
    step on one device), both made by ``make``."""
    from phalanx.partitioners import FixedShardsPartitioner

    ids = torch.tensor([[1, 2], [3, 3]])
    local = make()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    local_opt.zero_grad()
    local(ids).pow(2).mean().backward()
    local_opt.step()
    strategy = cluster.strategy(FixedShardsPartitioner(2))
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = make()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        optimizer.zero_grad()
        model(ids).pow(2).mean().backward()
        optimizer.step()

    coordinator.schedule(step)
    coordinator.join()
    return model, local


def test_a_tied_sharded_table_is_read_whole_where_another_module_uses_it(ps_1worker_2ps):

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(6, 4)
            self.out = torch.nn.Linear(4, 6, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids):
            return self.out(self.embed(ids))

    def make():
        torch.manual_seed(0)
        return Tied()

    model, local = _one_sgd_step_on_two_sharded_ps(ps_1worker_2ps, make)
    torch.testing.assert_close(model.embed.weight, local.embed.weight, rtol=1e-5, atol=1e-6)


def test_an_embedding_subclass_with_its_own_forward_gets_the_ids(ps_1worker_2ps):
    """Only `nn.Embedding`'s own forward is given no ids on a worker (its result is replaced
    by the lookup by rows); a subclass's forward still sees them."""

    class Checked(torch.nn.Embedding):
        def forward(self, ids):
            if ids.numel() == 0:
                raise AssertionError("the subclass's forward got no ids")
            return super().forward(ids)

    def make():
        torch.manual_seed(0)
        return Checked(6, 4)

    model, local = _one_sgd_step_on_two_sharded_ps(ps_1worker_2ps, make)
    torch.testing.assert_close(model.weight, local.weight, rtol=1e-5, atol=1e-6)


def test_variables_used_before_the_first_lookup_are_read_there_and_the_rows_alone_after(
    ps_1worker_2ps, monkeypatch
):
    from phalanx.ps.variables import PSClient

    class ScaledFirst(torch.nn.Module):  # a dense parameter used before the lookup
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(1.5))
            self.embed = torch.nn.Embedding(20, 3)
            self.out = torch.nn.Linear(3, 1)

        def forward(self, ids):
            gain = self.scale * 2.0
            return self.out(self.embed(ids) * gain)

    def make():
        torch.manual_seed(0)
        return ScaledFirst()

    def train(model, opt, ids):
        opt.zero_grad()
        model(ids).pow(2).mean().backward()
        opt.step()

    batches = torch.randint(0, 20, (3, 4), generator=torch.Generator().manual_seed(3))
    local = make()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for ids in batches:
        train(local, local_opt, ids)
    strategy = ps_1worker_2ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = make()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    alone, with_rows = [], []
    read, read_with_rows = PSClient.read_changed, PSClient.read_changed_and_rows
    monkeypatch.setattr(
        PSClient, "read_changed", lambda s, h, k: (alone.append(sorted(x.name for x in h)), read(s, h, k))[1]
    )
    monkeypatch.setattr(
        PSClient,
        "read_changed_and_rows",
        lambda s, h, k, t, r: (with_rows.append(sorted(x.name for x in h)), read_with_rows(s, h, k, t, r))[1],
    )
    for ids in batches:
        coordinator.schedule(train, args=(model, optimizer, ids))
        coordinator.join()
    for ours, theirs in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    # per step: the first use of `scale` reads every pending variable (scale, out.weight,
    # out.bias) in one read, then the lookup reads its rows only: two reads, as before
    assert len(alone) == len(with_rows) == len(batches)
    assert all(len(names) == 3 for names in alone)
    assert all(names == [] for names in with_rows)
