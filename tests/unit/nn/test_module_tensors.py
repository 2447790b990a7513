"""Inside a replica, modules read their replica's plain tensors:
no per-op dispatch, torch's fused kernels run, numbers identical to one device; in-place
writes of mirrored parameters outside the optimizer step still raise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.variables import DistributedVariable, MirroredVariable, set_aggregation


def test_a_replica_reads_its_plain_components(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 2)
        layer.register_buffer("mean", set_aggregation(torch.zeros(2), "mean", "on_write"))
        norm = nn.BatchNorm1d(2)
    seen = {}

    def read() -> None:
        index = phalanx.get_replica_context().replica_id_in_sync_group
        seen[index] = (layer.weight, norm.running_mean, layer.mean)

    mirrored_2cpu.run(read)
    for index, (weight, running_mean, mean) in seen.items():
        assert type(weight) is nn.Parameter or type(weight) is torch.Tensor
        assert weight is layer.weight.replica_leaf(index)
        assert running_mean is norm.running_mean.stored_components[index]
        assert isinstance(mean, MirroredVariable)  # aggregated: its writes are merged, keep the variable
    assert isinstance(layer.weight, MirroredVariable)  # outside run: the variable
    assert all(isinstance(p, DistributedVariable) for p in layer.parameters())


def _padded_encoder(strategy: phalanx.Strategy) -> torch.Tensor:
    torch.manual_seed(0)
    with strategy.scope():
        layer = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2, enable_nested_tensor=True
        ).eval()
    x = torch.randn(4, 5, 8)
    padding = torch.zeros(4, 5, dtype=torch.bool)
    padding[:, 3:] = True

    def infer(xb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return layer(xb, src_key_padding_mask=mask)

    data = strategy.experimental_distribute_dataset([(x, padding)])
    outputs = [strategy.run(infer, args=batch) for batch in data]
    return torch.cat(strategy.experimental_local_results(outputs[0]))


def test_the_fused_attention_path_runs_as_on_one_device(mirrored_2cpu):
    """The fused path (nested tensors) leaves padded positions exactly 0; the unfused path does
    not, so zeros on both sides show the fast path ran under Mirrored too. The unpadded outputs
    agree to a tolerance only: a batch of 4 and two batches of 2 take different GEMM kernels on
    some CPUs (Intel's differ in the last bits)."""
    expected = _padded_encoder(phalanx.OneDeviceStrategy("cpu"))
    got = _padded_encoder(mirrored_2cpu)
    for side in (expected, got):
        assert torch.equal(side[:, 3:], torch.zeros_like(side[:, 3:]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_an_unaggregated_write_in_a_replica_still_raises(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model = nn.Sequential(nn.Linear(2, 2))

    def write() -> None:
        with torch.no_grad():
            model[0].weight.mul_(2.0)

    with pytest.raises(
        RuntimeError,
        match=r"needs an aggregation.*Received: a write to `0\.weight` \(shape \(2, 2\)\) in replica \d, "
        r"outside optimizer\.step\(\)\. HINT: annotate it",
    ):
        mirrored_2cpu.run(write)


def test_the_optimizer_step_writes_are_allowed_and_replicas_stay_equal(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)

    def step(x: torch.Tensor) -> None:
        phalanx.compute_average_loss(layer(x).squeeze(1) ** 2, global_batch_size=4).backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in mirrored_2cpu.experimental_distribute_dataset([torch.randn(4, 3)] * 2):
        mirrored_2cpu.run(step, args=(batch,))
    first, second = layer.weight.components
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def _running_mean_after_double(strategy: phalanx.Strategy) -> torch.Tensor:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).double()
    x = torch.randn(8, 3, dtype=torch.float64) * 2 + 1
    for batch in strategy.experimental_distribute_dataset([x, x + 1]):
        strategy.run(model, args=(batch,))
    with strategy.scope():
        return model[1].running_mean.detach().clone()


def test_model_double_keeps_distributed_buffers(mirrored_2cpu):
    """Module._apply stores converted buffers past the hooks; they stay per-replica variables
    (a plain tensor there would be shared, and raced on, by every replica)."""
    expected = _running_mean_after_double(phalanx.OneDeviceStrategy("cpu"))
    got = _running_mean_after_double(mirrored_2cpu)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)  # the mean of means: the same


def test_a_buffer_set_outside_the_scope_is_written_into_the_variable(mirrored_2cpu):
    with mirrored_2cpu.scope():
        norm = nn.BatchNorm1d(2)
    variable = norm.running_mean
    norm.running_mean = torch.full((2,), 3.0)
    assert norm.running_mean is variable
    for component in variable.components:
        torch.testing.assert_close(component, torch.full((2,), 3.0))
