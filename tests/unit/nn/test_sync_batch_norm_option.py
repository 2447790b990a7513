"""`sync_batch_norm=True` on MirroredStrategy, CentralStorageStrategy and
MultiWorkerMirroredStrategy: batch-norm layers registered in the scope become SyncBatchNorm,
and training matches one device; without it, per-replica statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import phalanx
from phalanx.nn import SyncBatchNorm
from phalanx.nn.sync_batch_norm import converted_in_scope

GLOBAL_BATCH = 8


class ConvNet(nn.Module):
    """Batch norm as an attribute (HF style) and inside a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = nn.BatchNorm2d(3)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2 * GLOBAL_BATCH, 2, 4, 4, generator=generator, dtype=torch.float64)
    return x * 3 + 1, torch.randn(2 * GLOBAL_BATCH, 1, generator=generator, dtype=torch.float64)


def train(strategy: phalanx.Strategy) -> dict[str, np.ndarray]:
    """Two float64 steps of ConvNet (module level: the mwms_2workers runner imports it)."""
    torch.manual_seed(0)
    with strategy.scope():
        model = ConvNet().double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        losses = ((model(xb) - yb) ** 2).squeeze(1)
        phalanx.compute_average_loss(losses, global_batch_size=GLOBAL_BATCH).backward()
        optimizer.step()
        optimizer.zero_grad()

    dataset = phalanx.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    for batch in strategy.experimental_distribute_dataset(dataset):
        strategy.run(step, args=batch)
    kinds = sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__})
    weights = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    return {"kinds": np.array(kinds), **weights}


@pytest.fixture(scope="module")
def one_device_weights() -> dict[str, np.ndarray]:
    return train(phalanx.OneDeviceStrategy("cpu"))


def _assert_same(expected: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert list(got["kinds"]) == ["SyncBatchNorm"]
    for key, value in expected.items():
        if key != "kinds":
            np.testing.assert_allclose(got[key], value, rtol=1e-10, atol=1e-12, err_msg=key)


@pytest.mark.parametrize("make", [phalanx.MirroredStrategy, phalanx.CentralStorageStrategy])
def test_sync_batch_norm_trains_like_one_device(make, one_device_weights):
    strategy = make(["cpu:0", "cpu:1"], sync_batch_norm=True)
    try:
        _assert_same(one_device_weights, train(strategy))
    finally:
        strategy._threads.close()


def test_without_it_each_replica_normalises_its_own_slice(mirrored_2cpu, one_device_weights):
    got = train(mirrored_2cpu)
    assert list(got["kinds"]) == ["BatchNorm1d", "BatchNorm2d"]
    assert not np.allclose(got["norm.running_var"], one_device_weights["norm.running_var"], rtol=1e-6)
    assert not np.allclose(got["conv.weight"], one_device_weights["conv.weight"], rtol=1e-6)


@pytest.mark.parametrize("runner", ["mwms_2workers"], indirect=True)
def test_sync_batch_norm_under_multi_worker(runner, one_device_weights):
    for got in runner.run(_multi_worker_synced):
        _assert_same(one_device_weights, got)


def _multi_worker_synced(strategy: phalanx.Strategy) -> dict[str, np.ndarray]:
    strategy._sync_batch_norm = True  # the runner made the strategy (the constructor: below)
    return train(strategy)


def test_multi_worker_takes_the_option(monkeypatch):
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    strategy = phalanx.MultiWorkerMirroredStrategy(sync_batch_norm=True)
    try:
        with strategy.scope():
            model = nn.Sequential(nn.BatchNorm2d(3))
        assert type(model[0]) is SyncBatchNorm
    finally:
        strategy.close()


def test_the_converted_layer_keeps_the_variables_made_in_the_scope():
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], sync_batch_norm=True)
    try:
        with strategy.scope():
            model = nn.Sequential(nn.BatchNorm1d(3, momentum=0.3, eps=1e-3))
        layer = model[0]
        assert type(layer) is SyncBatchNorm
        assert (layer.momentum, layer.eps, layer.num_features) == (0.3, 1e-3, 3)
        assert type(layer.weight) is phalanx.MirroredVariable
        assert {p for p in strategy.variable_policy.variables()} >= set(model.parameters())
    finally:
        strategy._threads.close()


def test_other_modules_and_sync_layers_are_kept():
    assert converted_in_scope(nn.Linear(2, 2)) is None
    assert converted_in_scope(SyncBatchNorm(2)) is None


def test_a_lazy_layer_is_refused_with_a_hint():
    """(Under MultiWorkerMirrored with one local replica lazy parameters stay plain, so a lazy
    layer reaches the conversion.)"""
    with pytest.raises(ValueError, match=r"cannot convert an uninitialised lazy one.*HINT: give"):
        converted_in_scope(nn.LazyBatchNorm1d())
