"""``Model.compile(gradient_accumulation_steps=k)`` on one device: Keras 3's step-by-step
semantics (logs and metrics per step, an update every ``k`` steps) and loss scaling. The
strategies' numbers are checked by tests/multiprocess/test_gradient_accumulation.py."""

from __future__ import annotations

import torch
from torch import nn

import phalanx


def _model(strategy: phalanx.Strategy, k: int | None) -> tuple[phalanx.Model, list[int]]:
    with strategy.scope():
        torch.manual_seed(0)
        model = phalanx.Model(nn.Linear(3, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model.compile(optimizer=optimizer, loss="mse", gradient_accumulation_steps=k)
    steps: list[int] = []
    optimizer.register_step_post_hook(lambda *args: steps.append(1))
    return model, steps


def test_train_on_batch_updates_every_k_calls_and_reports_each_calls_own_loss(one_device):
    model, steps = _model(one_device, 2)
    initial = nn.Linear(3, 1)
    initial.load_state_dict(model.module.state_dict())
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(3)]

    first = model.train_on_batch(*batches[0], return_dict=True)
    assert steps == []
    torch.testing.assert_close(model.module.weight.detach(), initial.weight.detach())
    second = model.train_on_batch(*batches[1], return_dict=True)
    assert steps == [1]  # the update: the mean of both batches' gradients
    with torch.no_grad():
        for batch, logs in zip(batches, (first, second), strict=False):
            want = nn.functional.mse_loss(initial(batch[0]), batch[1]).item()
            assert abs(logs["loss"] - want) < 1e-6  # each step's loss, unscaled, at the weights it saw
    x = torch.cat([batches[0][0], batches[1][0]])
    y = torch.cat([batches[0][1], batches[1][1]])
    nn.functional.mse_loss(initial(x), y).backward()
    with torch.no_grad():
        for p in initial.parameters():
            p -= 0.1 * p.grad
    torch.testing.assert_close(model.module.weight.detach(), initial.weight.detach())
    model.train_on_batch(*batches[2])
    assert steps == [1]  # the count carries on: the next update is two calls later


def test_loss_scaling_steps_once_per_update_near_the_larger_batchs_weights(one_device):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, generator=gen), torch.randn(64, 1, generator=gen)
    whole, _ = _model(one_device, None)  # float32: dynamic scaling may skip a float16 step of its own
    whole.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    phalanx.mixed_precision.set_global_policy("mixed_float16")
    try:
        accumulated, steps = _model(one_device, 4)
        accumulated.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    finally:
        phalanx.mixed_precision.set_global_policy("float32")
    assert accumulated._loss_scale is not None
    assert len(steps) == 2  # scaled gradients unscaled and checked once per update
    torch.testing.assert_close(accumulated.module.weight, whole.module.weight, rtol=1e-3, atol=1e-3)
