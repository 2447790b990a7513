"""FullyShardedStrategy in one process (a cluster of one, a process group of one) and its errors.

Two and more workers are tested with real processes in tests/multiprocess/test_fully_sharded.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import phalanx
from phalanx.experimental import FullyShardedStrategy
from support import oracle


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def strategy():
    made = FullyShardedStrategy()
    yield made
    made.close()
    assert not dist.is_initialized(), "close() ends the process group it started"


def test_one_worker_trains_like_one_device_and_state_dicts_are_full(strategy):
    losses, state, _ = oracle.run_ctl(strategy)
    ref_losses, ref_state, _ = oracle.run_ctl(phalanx.OneDeviceStrategy("cpu:0"))
    np.testing.assert_allclose(losses, ref_losses, **oracle.LOSS_TOL)
    for key, value in ref_state.items():
        assert type(state[key]) is torch.Tensor
        np.testing.assert_allclose(state[key].numpy(), value.numpy(), **oracle.WEIGHT_TOL)


def test_load_state_dict_takes_full_tensors_and_sharded_state_dicts_give_shards(strategy):
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    strategy.run(lambda: model(torch.ones(1, 4)))  # sharded before the first run
    assert all(isinstance(p, DTensor) for p in model.parameters())
    wanted = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    model.load_state_dict(wanted)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, wanted[key])
    with strategy.sharded_state_dicts():
        assert all(isinstance(v, DTensor) for v in model.state_dict().values())


def test_an_optimizer_made_after_the_first_run_also_steps_the_shards(strategy):
    with strategy.scope():
        model = nn.Linear(3, 1)
    strategy.run(lambda: model(torch.ones(1, 3)))
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def step() -> None:
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()

    before = model.state_dict()["bias"].clone()
    strategy.run(step)
    torch.testing.assert_close(model.state_dict()["bias"], before - 1.0)


def test_a_parameter_the_strategy_did_not_make_is_named_at_the_step(strategy):
    with strategy.scope():
        model = nn.Linear(3, 1)
    stranger = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)

    def step() -> None:
        (model(torch.ones(1, 3)).sum() + stranger.sum()).backward()
        optimizer.step()

    with pytest.raises(RuntimeError, match="did not shard"):
        strategy.run(step)


def test_parameters_added_after_sharding_are_refused(strategy):
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 3))
    strategy.run(lambda: model(torch.ones(1, 3)))
    with strategy.scope():
        model.append(nn.Linear(3, 1))
    with pytest.raises(RuntimeError, match="after FullyShardedStrategy sharded it"):
        strategy.run(lambda: model(torch.ones(1, 3)))


def test_an_aggregated_variable_is_refused_with_what_to_use(strategy):
    with strategy.scope(), pytest.raises(ValueError, match="use MultiWorkerMirroredStrategy"):
        phalanx.Variable(torch.zeros(2), aggregation="mean")


def test_bad_arguments_say_what_is_accepted():
    with pytest.raises(ValueError, match="shard must be one of"):
        FullyShardedStrategy(shard="zero4")
    with pytest.raises(ValueError, match="one replica per worker"):
        FullyShardedStrategy(devices=["cpu:0", "cpu:1"])


def test_sparse_gradients_are_refused_with_what_to_use(strategy):
    with strategy.scope():
        model = nn.Sequential(nn.EmbeddingBag(10, 3, sparse=True), nn.Linear(3, 1))
    with pytest.raises(ValueError, match="sparse=False, or MultiWorkerMirroredStrategy"):
        strategy.run(lambda: model(torch.tensor([[1, 2]])))


def test_a_module_reading_its_childs_weight_is_one_unit_with_it(strategy):
    with strategy.scope():
        attention = nn.MultiheadAttention(4, 2)  # its forward reads out_proj.weight itself
    x = torch.randn(3, 1, 4)
    expected = nn.MultiheadAttention(4, 2)
    expected.load_state_dict(attention.state_dict())
    got = strategy.run(lambda: attention(x, x, x)[0])
    torch.testing.assert_close(got, expected(x, x, x)[0])


class Tower(nn.Module):
    """Layers at two depths, BatchNorm buffers, attention that resets its out_proj's bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 6)
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)), nn.Linear(6, 6))
        self.attention = nn.MultiheadAttention(6, 2)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(x)).unsqueeze(1)
        return self.head(self.attention(h, h, h)[0].squeeze(1))


def test_a_model_built_on_the_meta_device_gets_the_values_of_one_built_on_the_cpu(strategy):
    torch.manual_seed(3)
    expected = Tower()
    torch.manual_seed(3)
    with strategy.scope(), torch.device("meta"):
        model = Tower()
    assert all(p.is_meta for p in model.parameters())
    torch.randn(100)  # randomness used between the scope and the first run changes nothing
    x = torch.randn(4, 5)
    got = strategy.run(lambda: model(x))
    torch.testing.assert_close(got, expected(x))  # both in training mode: BatchNorm's stats move
    for key, value in expected.state_dict().items():
        assert not model.state_dict()[key].is_meta
        torch.testing.assert_close(model.state_dict()[key], value, msg=key)


def test_meta_parameters_take_memory_one_layer_at_a_time(strategy):
    alive: list[int] = []

    class Probe(nn.Linear):
        def reset_parameters(self) -> None:  # counts the full (not sharded, not meta) parameters
            super().reset_parameters()
            if not self.weight.is_meta:  # not the call in __init__
                full = [p for p in model.parameters() if not p.is_meta and not isinstance(p, DTensor)]
                alive.append(len(full))

    with strategy.scope(), torch.device("meta"):
        model = nn.Sequential(*[Probe(8, 8) for _ in range(5)])
    strategy.run(lambda: model(torch.randn(2, 8)))
    assert alive == [2] * 5  # each layer's weight and bias, never another layer's


def test_a_meta_parameter_without_a_reset_is_named(strategy):
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with strategy.scope(), torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ValueError, match=r"Scale made parameter gain on the meta device and has no reset"):
        strategy.run(lambda: model(torch.randn(2, 3)))


def test_a_meta_parameter_that_the_reset_leaves_unset_is_named(strategy):
    class Half(nn.Linear):
        def reset_parameters(self) -> None:
            nn.init.zeros_(self.weight)  # forgets the bias

    with strategy.scope(), torch.device("meta"):
        model = Half(3, 3)
    with pytest.raises(ValueError, match=r"Parameters \['bias'\] were made on the meta device"):
        strategy.run(lambda: model(torch.randn(2, 3)))


def test_a_meta_buffer_without_a_reset_is_named(strategy):
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("index", torch.arange(3.0))
            self.weight = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight(x + self.index)

    with strategy.scope(), torch.device("meta"):
        model = Positions()
    with pytest.raises(ValueError, match=r"Positions made buffer index on the meta device"):
        strategy.run(lambda: model(torch.randn(2, 3)))


@pytest.mark.parametrize(
    "make", [lambda: phalanx.MirroredStrategy(["cpu:0", "cpu:1"]), lambda: phalanx.OneDeviceStrategy("cpu:0")]
)
def test_strategies_that_hold_full_copies_refuse_meta_parameters_with_what_to_use(make):
    other = make()
    with (
        other.scope(),
        torch.device("meta"),
        pytest.raises(ValueError, match="use phalanx.experimental.FullyShardedStrategy"),
    ):
        nn.Linear(3, 3)


def test_a_state_loaded_or_saved_before_the_first_run_is_the_models_not_meta(strategy):
    torch.manual_seed(5)
    saved = Tower().state_dict()
    with strategy.scope(), torch.device("meta"):
        model = Tower()
    model.load_state_dict(saved)  # materialises first: the restore is kept, not reset
    for key, value in saved.items():
        torch.testing.assert_close(model.state_dict()[key], value, msg=key)
    with strategy.scope(), torch.device("meta"):
        fresh = Tower()
    state = fresh.state_dict()  # a save before the first run has values
    assert not any(v.is_meta for v in state.values())
