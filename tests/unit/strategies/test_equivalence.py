"""Mirrored with 2 and 4 CPU replicas trains exactly like one device at the same global batch.

The model has (Sync)BatchNorm and Dropout: SyncBatchNorm normalises over the global batch,
and dropout masks are keyed by each example's global index (phalanx/nn/dropout.py), so the
number of replicas does not change the numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
}


def _train(strategy, make_optimizer, steps=5):
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(
            nn.Linear(6, 16, bias=False),
            phalanx.nn.SyncBatchNorm(16),  # (a bias before BN has ~0 grad)
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(16, 3),
        )
        optimizer = make_optimizer(model.parameters())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(steps)]

    def step(x, y):
        loss = phalanx.compute_average_loss(nn.functional.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = [
        strategy.reduce("sum", strategy.run(step, args=batch), axis=None).item()
        for batch in strategy.experimental_distribute_dataset(data)
    ]
    return losses, model.state_dict(), optimizer.state_dict()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("replicas", [2, 4])
def test_mirrored_matches_single_device(optimizer, replicas):
    ref_losses, ref_state, ref_opt = _train(phalanx.OneDeviceStrategy("cpu"), OPTIMIZERS[optimizer])
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    try:
        losses, state, opt_state = _train(strategy, OPTIMIZERS[optimizer])
    finally:
        strategy._threads.close()
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=key)
    # each replica counted each step once, in its own optimizer state
    for key, value in ref_opt["state"][0].items():
        # (state divides by running RMS values, which amplifies float32 summation-order noise)
        torch.testing.assert_close(opt_state["state"][0][key], value, rtol=1e-3, atol=1e-5, msg=key)


def test_central_storage_matches_single_device():
    ref_losses, ref_state, _ = _train(phalanx.OneDeviceStrategy("cpu"), OPTIMIZERS["adam"])
    strategy = phalanx.CentralStorageStrategy(["cpu:0", "cpu:1"])
    try:
        losses, state, _ = _train(strategy, OPTIMIZERS["adam"])
    finally:
        strategy._threads.close()
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=key)
