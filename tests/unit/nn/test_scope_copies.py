"""Copies (copy.deepcopy) of modules and variables in a strategy's scope, and the error that
names a parameter an optimizer holds but the strategy never made."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from torch import nn

import phalanx
from phalanx.variables import MirroredVariable, SyncOnReadVariable, VariableAggregation, set_aggregation

GLOBAL_BATCH = 8
STRATEGIES = ["one_device", "mirrored_2cpu", "central_storage_2cpu", "mwms_2workers"]


def _encoder_decoder() -> nn.Module:
    torch.manual_seed(0)

    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # both deep-copy their layer (torch's _get_clones)
            self.encoder = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2
            )
            self.decoder = nn.TransformerDecoder(
                nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2
            )
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.decoder(x, self.encoder(x))).mean(1)

    return EncoderDecoder()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2 * GLOBAL_BATCH, 5, 16, generator=generator), torch.randn(
        2 * GLOBAL_BATCH, 1, generator=generator
    )


def train_transformer(strategy: phalanx.Strategy) -> dict[str, np.ndarray]:
    """Three custom-loop steps of an encoder-decoder made in the scope (module level: the
    mwms_2workers runner imports it in each worker)."""
    with strategy.scope():
        model = _encoder_decoder()
        # SGD: Adam would blow up float noise in the key bias, whose true gradient is 0
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    dataset = phalanx.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat(2)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        losses = ((model(xb) - yb) ** 2).squeeze(1)
        loss = phalanx.compute_average_loss(losses, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for batch in strategy.experimental_distribute_dataset(dataset):
        strategy.run(step, args=batch)
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def fit_transformer(strategy: phalanx.Strategy) -> dict[str, np.ndarray]:
    with strategy.scope():
        model = phalanx.Model(_encoder_decoder())
        model.compile(optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss="mse")
    x, y = _data()
    model.fit(x.numpy(), y.numpy(), batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return {k: v.detach().clone().numpy() for k, v in model.module.state_dict().items()}


def _assert_same(expected: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.fixture(scope="module")
def one_device_weights() -> dict[str, dict[str, np.ndarray]]:
    strategy = phalanx.OneDeviceStrategy("cpu")
    return {"ctl": train_transformer(strategy), "fit": fit_transformer(strategy)}


@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_transformer_encoder_and_decoder_train_like_one_device(runner, one_device_weights):
    for weights in runner.run(train_transformer):
        _assert_same(one_device_weights["ctl"], weights)


@pytest.mark.parametrize("runner", ["mirrored_2cpu", "central_storage_2cpu"], indirect=True)
def test_transformer_encoder_and_decoder_fit_like_one_device(runner, one_device_weights):
    for weights in runner.run(fit_transformer):
        _assert_same(one_device_weights["fit"], weights)


def test_deepcopy_in_scope_gives_new_variables_of_the_same_kind(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(3, 2)
        layer.register_buffer("total", set_aggregation(torch.zeros(2), "sum"))
        layer.register_buffer("step", set_aggregation(torch.zeros(()), "mean", "on_write"))
        clone = copy.deepcopy(layer)
        weight = copy.deepcopy(layer.weight)
    assert type(clone.weight) is MirroredVariable
    assert clone.weight is not layer.weight
    assert type(weight) is MirroredVariable
    assert clone.weight._is_param
    assert type(clone.total) is SyncOnReadVariable
    assert clone.total.aggregation is VariableAggregation.SUM
    assert type(clone.step) is MirroredVariable
    assert not clone.step._is_param
    assert clone.step.aggregation is VariableAggregation.MEAN
    torch.testing.assert_close(clone.weight.primary, layer.weight.primary)
    with torch.no_grad():
        clone.weight.add_(1.0)  # the copy is independent of the original
    torch.testing.assert_close(clone.weight.primary, layer.weight.primary + 1.0)


def test_deepcopy_keeps_shared_parameters_shared(mirrored_2cpu):
    with mirrored_2cpu.scope():
        embed = nn.Embedding(5, 4)
        head = nn.Linear(4, 5, bias=False)
        head.weight = embed.weight  # tied weights
        clone = copy.deepcopy(nn.ModuleList([embed, head]))
    assert clone[0].weight is clone[1].weight
    assert type(clone[0].weight) is MirroredVariable


def test_copies_of_plain_parameters_are_registered_with_the_strategy(tmp_path):
    """MultiWorkerMirrored with one local replica keeps plain parameters (DDP layout): a copy
    registered in the scope gets its tensors tracked like the original's."""
    strategy = phalanx.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            layer = nn.Linear(2, 2)
            stack = nn.ModuleList(copy.deepcopy(layer) for _ in range(2))
            stray = copy.deepcopy(layer)  # copied but never registered in the scope
            optimizer = torch.optim.SGD(stack.parameters(), lr=0.1)
        tracked = strategy._plain
        assert all(tracked[id(p)]() is p for p in stack.parameters())
        assert all(id(p) not in tracked for p in stray.parameters())

        def step() -> None:
            stack[1](stack[0](torch.ones(1, 2))).sum().backward()
            optimizer.step()

        strategy.run(step)
    finally:
        strategy.close()


def _step_with(strategy: phalanx.Strategy, module: nn.Module) -> None:
    with strategy.scope():
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    def step() -> None:
        module(torch.ones(1, 5, 16)).sum().backward()
        optimizer.step()

    strategy.run(step)


def test_error_names_a_parameter_made_outside_the_scope(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model = nn.Sequential(nn.Linear(16, 16))
    model.append(nn.Linear(16, 2))  # outside the scope
    with pytest.raises(
        RuntimeError,
        match=r"Received: `1\.weight` \(shape \(2, 16\)\), which was not created in this strategy's "
        r"scope: it was made outside the scope\..*HINT: create the model",
    ):
        _step_with(mirrored_2cpu, model)


def test_error_names_a_copy_made_outside_the_scope(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(16, 2)
    clone = copy.deepcopy(layer)
    with pytest.raises(
        RuntimeError,
        match=r"`weight` \(shape \(2, 16\)\).*it was copied \(copy\.deepcopy\) outside the scope from a "
        r"variable of MirroredStrategy",
    ):
        _step_with(mirrored_2cpu, clone)


def test_error_names_a_variable_of_another_strategy(mirrored_2cpu):
    other = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with other.scope():
            layer = nn.Linear(16, 2)
    finally:
        other._threads.close()
    with pytest.raises(
        RuntimeError, match=r"`weight`.*made in the scope of another strategy, MirroredStrategy"
    ):
        _step_with(mirrored_2cpu, layer)


def unregistered_copy_error(strategy: phalanx.Strategy) -> str:
    with strategy.scope():
        holder = nn.Sequential(nn.Linear(16, 2))
        stray = copy.deepcopy(holder)  # plain parameters (one local replica), never registered
    try:
        _step_with(strategy, stray)
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("runner", ["mwms_2workers"], indirect=True)
def test_error_names_an_unregistered_copy_under_multi_worker(runner):
    for message in runner.run(unregistered_copy_error):
        assert re.search(
            r"Received: `0\.(weight|bias)` \(shape \(2,( 16)?\)\).*belongs to a copy \(copy\.deepcopy\) of a "
            r"module made in the scope, and the copy was not registered",
            message,
        ), message
