"""SyncBatchNorm over replicas equals BatchNorm over the global batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.nn import SyncBatchNorm


@pytest.mark.parametrize(("replicas", "batch"), [(2, 8), (4, 12), (2, 7), (4, 3)])
def test_matches_batchnorm_on_the_global_batch(replicas, batch):
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    try:
        _check(strategy, batch)
    finally:
        strategy._threads.close()


def _check(strategy, batch):
    torch.manual_seed(0)
    x = torch.randn(batch, 3, 5, 5)
    reference = nn.BatchNorm2d(3)
    with torch.no_grad():
        reference.weight.uniform_()
        reference.bias.uniform_()
    with strategy.scope():
        sync = SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))
    sync.load_state_dict({f"0.{k}": v for k, v in reference.state_dict().items()})

    ref_x = x.clone().requires_grad_()
    ref_out = reference(ref_x)
    (ref_out * torch.arange(ref_out.numel()).reshape(ref_out.shape)).sum().backward()

    dist = strategy.experimental_distribute_dataset([x])

    def step(xb):
        xb = xb.clone().requires_grad_()
        out = sync(xb)
        return out, xb

    (batch_x,) = [b for b in dist]
    _outs, _inputs = [], []
    # grads need the per-replica slice offsets: weight each output like the reference did
    sizes = [t.shape[0] for t in strategy.experimental_local_results(batch_x)]

    def step_with_loss(xb):
        out, xin = step(xb)
        index = phalanx.get_replica_context().replica_id_in_sync_group
        start = sum(sizes[:index]) * out.shape[1:].numel()
        weights = torch.arange(start, start + out.numel()).reshape(out.shape)
        (out * weights).sum().backward()
        return out.detach(), xin.grad

    result = strategy.run(step_with_loss, args=(batch_x,))
    out, grad = (strategy.gather(v, axis=0) for v in result)
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, ref_x.grad, rtol=1e-4, atol=1e-4)
    param_grads = sum(c.grad for c in sync[0].weight.components)  # summed at optimizer.step()
    torch.testing.assert_close(param_grads, reference.weight.grad, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(sync[0].running_mean, reference.running_mean)
    torch.testing.assert_close(sync[0].running_var, reference.running_var)


def test_eval_mode_and_single_replica_are_plain_batchnorm(mirrored_2cpu, monkeypatch):
    with mirrored_2cpu.scope():
        sync = SyncBatchNorm(3)
    sync.eval()

    def no_collective(*args, **kwargs):
        raise AssertionError("eval mode must not communicate")

    monkeypatch.setattr(phalanx.ReplicaContext, "all_reduce", no_collective)
    x = torch.randn(4, 3)
    (xb,) = list(mirrored_2cpu.experimental_distribute_dataset([x]))
    out = mirrored_2cpu.gather(mirrored_2cpu.run(sync, args=(xb,)), axis=0)
    torch.testing.assert_close(out, x / torch.sqrt(torch.tensor(1 + 1e-5)))
    plain = SyncBatchNorm(3)
    torch.testing.assert_close(plain(x), nn.BatchNorm1d(3)(x))
    with pytest.raises(ValueError, match=r"expects inputs of shape \(N, C"):
        plain(torch.randn(3))
