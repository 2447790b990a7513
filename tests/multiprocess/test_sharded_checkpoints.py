"""Sharded checkpoints (torch.distributed.checkpoint): 2 FullySharded workers write one copy of
the state, which restores onto 3 MultiWorkerMirrored workers, one device and Mirrored with the
same weights and optimizer state."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import phalanx
from phalanx.train import Checkpoint
from support.strategies import ProcessRunner

pytestmark = pytest.mark.multiprocess
TOL = {"rtol": 1e-6, "atol": 1e-7}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 1023), nn.Tanh(), nn.Linear(1023, 129))  # uneven shards


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full weights and optimizer state by parameter name (a collective under several workers)."""
    options = StateDictOptions(full_state_dict=True)
    optim = get_optimizer_state_dict(model, optimizer, options=options)["state"]
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {f"{p}/{k}": torch.as_tensor(v).clone() for p, s in optim.items() for k, v in s.items()},
    }


def _build(strategy: phalanx.Strategy) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3 + strategy.worker_rank)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer


def train_and_save(strategy: phalanx.Strategy, folder: str) -> dict:
    model, optimizer = _build(strategy)

    def step(x: torch.Tensor) -> None:
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for x in strategy.experimental_distribute_dataset([torch.randn(4, 5) for _ in range(2)]):
        strategy.run(step, args=(x,))
    checkpoint = Checkpoint(model=model, optimizer=optimizer, epoch=phalanx.checkpoint.Counter(7))
    path = checkpoint.save(os.path.join(folder, "ckpt"))
    pending = checkpoint.save(os.path.join(folder, "async"), blocking=False)
    return {"path": path, "async": pending.result(timeout=60), **_full_state(model, optimizer)}


def restore(strategy: phalanx.Strategy, path: str) -> dict:
    model, optimizer = _build(strategy)
    epoch = phalanx.checkpoint.Counter(0)
    Checkpoint(model=model, optimizer=optimizer, epoch=epoch).read(path)
    return {"epoch": epoch.value, **_full_state(model, optimizer)}


def _same(got: dict, expected: dict) -> None:
    for part in ("weights", "optimizer"):
        assert got[part].keys() == expected[part].keys(), part
        for key, value in expected[part].items():
            np.testing.assert_allclose(got[part][key].numpy(), value.numpy(), **TOL, err_msg=key)


def test_two_sharded_workers_restore_on_three_workers_one_device_and_mirrored(fsdp_2workers, tmp_path: Path):
    saved = fsdp_2workers.run(train_and_save, str(tmp_path))
    path, expected = saved[0]["path"], saved[0]
    assert path.endswith(".dcp")
    assert sorted(os.listdir(tmp_path)) == ["async-2.dcp", "checkpoint.json", "ckpt-1.dcp"]
    files = sorted(os.listdir(path))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each worker its part
    state_bytes = sum(v.numel() * 4 for v in expected["weights"].values()) * 3  # + Adam's 2 moments
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in files if f.endswith(".distcp"))
    assert state_bytes <= on_disk < 1.3 * state_bytes  # one copy in total

    three = ProcessRunner("mwms_3workers", "MultiWorkerMirroredStrategy", tmp_path / "three", 3)
    (tmp_path / "three").mkdir()
    for worker in three.run(restore, path):
        assert worker["epoch"] == 7
        _same(worker, expected)
    _same(restore(phalanx.OneDeviceStrategy("cpu:0"), saved[0]["async"]), expected)
    _same(restore(phalanx.OneDeviceStrategy("cpu:0"), path), expected)
    mirrored = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        _same(restore(mirrored, path), expected)
    finally:
        mirrored._threads.close()


def fit_with_model_checkpoints(strategy: phalanx.Strategy, folder: str) -> dict:
    torch.manual_seed(5)
    x, y = torch.randn(32, 5).numpy(), torch.randn(32, 129).numpy()
    with strategy.scope():
        model = phalanx.Model(_model())
        model.compile(optimizer=torch.optim.Adam(model.parameters(), lr=0.01), loss="mse")
    callbacks = [
        phalanx.callbacks.ModelCheckpoint(os.path.join(folder, "model-{epoch}")),  # sharded model: a folder
        phalanx.callbacks.ModelCheckpoint(os.path.join(folder, "w-{epoch}.dcp"), save_weights_only=True),
    ]
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return _full_state(model.module, model.optimizer)


def test_model_checkpoint_of_sharded_workers_writes_each_part_once_and_loads_on_one_device(
    fsdp_2workers, tmp_path: Path
):
    expected = fsdp_2workers.run(fit_with_model_checkpoints, str(tmp_path))[0]
    assert sorted(os.listdir(tmp_path)) == ["model-1", "model-2", "w-1.dcp", "w-2.dcp"]  # nothing left over
    files = sorted(os.listdir(tmp_path / "model-2"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each worker its part
    state_bytes = sum(v.numel() * 4 for v in expected["weights"].values()) * 3  # + Adam's 2 moments
    on_disk = sum((tmp_path / "model-2" / f).stat().st_size for f in files if f.endswith(".distcp"))
    assert state_bytes <= on_disk < 1.3 * state_bytes  # one copy in total

    with phalanx.OneDeviceStrategy("cpu:0").scope():
        loaded = phalanx.load_model(str(tmp_path / "model-2"))
        weights_only = phalanx.Model(_model())
    weights_only.load_weights(str(tmp_path / "w-2.dcp"))
    _same(_full_state(loaded.module, loaded.optimizer), expected)
    for key, value in expected["weights"].items():
        np.testing.assert_allclose(weights_only.module.state_dict()[key].numpy(), value.numpy(), **TOL)
