"""SyncBatchNorm over replicas equals torch BatchNorm over the global batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.nn import SyncBatchNorm

# (torch class, shape of one example)
KINDS = {
    "1d_nc": (nn.BatchNorm1d, (3,)),
    "1d_ncl": (nn.BatchNorm1d, (3, 4)),
    "2d": (nn.BatchNorm2d, (3, 4, 4)),
    "3d": (nn.BatchNorm3d, (3, 2, 3, 2)),
}


@pytest.fixture
def make_mirrored():
    made = []

    def make(replicas, **kwargs):
        made.append(phalanx.MirroredStrategy([f"cpu:{i}" for i in range(replicas)], **kwargs))
        return made[-1]

    yield make
    for strategy in made:
        strategy._threads.close()


def _reference_and_sync(strategy, kind, **bn_kwargs):
    torch_cls, _ = KINDS[kind]
    reference = torch_cls(3, **bn_kwargs)
    if reference.affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            reference.bias.uniform_(-0.5, 0.5)
    plain_copy = torch_cls(3, **bn_kwargs)
    plain_copy.load_state_dict(reference.state_dict())
    with strategy.scope():
        sync = SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(plain_copy))[0]
    return reference, sync


def _steps(strategy, reference, sync, batches):
    """Runs reference and sync on the same global batches; compares each step."""
    dist = strategy.experimental_distribute_dataset(batches)

    def step(x, upstream):
        x = x.clone().requires_grad_()
        out = sync(x)
        (out * upstream).sum().backward()
        return out.detach(), x.grad

    for (x, upstream), dist_batch in zip(batches, dist, strict=True):
        ref_x = x.clone().requires_grad_()
        ref_out = reference(ref_x)
        (ref_out * upstream).sum().backward()
        out, grad = (strategy.gather(v, axis=0) for v in strategy.run(step, args=dist_batch))
        torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, ref_x.grad, rtol=1e-4, atol=1e-5)
        if reference.affine:
            for name in ("weight", "bias"):
                var, ref_param = getattr(sync, name), getattr(reference, name)
                for c in var.components:  # every replica holds the sum once backward returns
                    torch.testing.assert_close(c.grad, ref_param.grad, rtol=1e-4, atol=1e-4)
                    c.grad = None
                ref_param.grad = None
        if reference.track_running_stats:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                expected = getattr(reference, name)
                torch.testing.assert_close(getattr(sync, name), expected, rtol=1e-5, atol=1e-6)
                for component in getattr(sync, name).components:  # the same on every replica
                    torch.testing.assert_close(component, expected, rtol=1e-5, atol=1e-6)


def _batches(kind, sizes, seed=0, loc=0.0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    shape = KINDS[kind][1]
    return [
        (loc + scale * torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g))
        for n in sizes
    ]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(
    ("replicas", "sizes"),
    [(2, [8, 8]), (2, [7, 5]), (4, [12, 3])],  # even; uneven 7 -> 4/3; 3 over 4 leaves a replica empty
)
def test_matches_batchnorm_on_the_global_batch(make_mirrored, kind, replicas, sizes):
    strategy = make_mirrored(replicas)
    reference, sync = _reference_and_sync(strategy, kind)
    _steps(strategy, reference, sync, _batches(kind, sizes))


@pytest.mark.parametrize(
    "bn_kwargs",
    [
        {"momentum": None},  # cumulative average
        {"momentum": 0.3, "eps": 1e-3},
        {"affine": False},
        {"track_running_stats": False},
    ],
    ids=["momentum_none", "momentum_eps", "no_affine", "no_running_stats"],
)
def test_options_match_batchnorm(make_mirrored, bn_kwargs):
    strategy = make_mirrored(2)
    reference, sync = _reference_and_sync(strategy, "2d", **bn_kwargs)
    _steps(strategy, reference, sync, _batches("2d", [6, 5, 4]))


def test_large_mean_keeps_the_variance(make_mirrored):
    # E[x^2] - E[x]^2 in float32 loses a variance of 1 under a mean of 1e4 entirely (error ~10);
    # float32 itself resolves x - mean only to ~1e-3 there.
    strategy = make_mirrored(2)
    with strategy.scope():
        bn = SyncBatchNorm(2, momentum=1.0)
    x = 1e4 + torch.randn(64, 2, dtype=torch.float64)
    (xb,) = list(strategy.experimental_distribute_dataset([x.float()]))
    out = strategy.gather(strategy.run(bn, args=(xb,)), axis=0)
    reference = nn.BatchNorm1d(2, momentum=1.0).double()
    torch.testing.assert_close(out.double(), reference(x), rtol=0, atol=5e-3)
    torch.testing.assert_close(bn.running_var.double(), reference.running_var, rtol=1e-3, atol=0)


def test_one_all_reduce_per_training_call_and_none_in_eval(make_mirrored, monkeypatch):
    strategy = make_mirrored(2)
    with strategy.scope():
        bn = SyncBatchNorm(3)
    calls = []
    original = phalanx.ReplicaContext.all_reduce

    def counting(self, *args, **kwargs):
        calls.append(self.replica_id_in_sync_group)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(phalanx.ReplicaContext, "all_reduce", counting)
    (x,) = list(strategy.experimental_distribute_dataset([torch.randn(6, 3) * 3 + 1]))
    strategy.run(bn, args=(x,))
    assert sorted(calls) == [0, 1]
    running_mean = bn.running_mean.clone()

    bn.eval()
    calls.clear()
    out = strategy.gather(strategy.run(bn, args=(x,)), axis=0)
    assert calls == []
    expected = (strategy.gather(x, axis=0) - running_mean) / torch.sqrt(bn.running_var + bn.eps)
    torch.testing.assert_close(out, expected * bn.weight + bn.bias)
    # eval outside run (cross-replica context) needs no replicas at all
    torch.testing.assert_close(bn(strategy.gather(x, axis=0)), out)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_is_torch_batchnorm_with_one_replica(kind, one_device):
    torch_cls, shape = KINDS[kind]
    torch.manual_seed(0)
    x = torch.randn(5, *shape)
    reference = torch_cls(3, momentum=None)
    plain = SyncBatchNorm(3, momentum=None)  # outside any strategy: the default replica context
    with one_device.scope():
        in_scope = SyncBatchNorm(3, momentum=None)
    for _ in range(2):
        expected = reference(x)
        torch.testing.assert_close(plain(x), expected)
        torch.testing.assert_close(one_device.run(in_scope, args=(x,)), expected)
    for module in (plain, in_scope):
        torch.testing.assert_close(module.running_var, reference.running_var)
        assert module.num_batches_tracked.item() == 2
    for module in (reference, plain, in_scope):
        module.eval()
    torch.testing.assert_close(plain(x), reference(x))
    torch.testing.assert_close(one_device.run(in_scope, args=(x,)), reference(x))


def test_training_call_in_cross_replica_context_updates_every_replica(make_mirrored):
    strategy = make_mirrored(2)
    reference = nn.BatchNorm1d(3)
    with strategy.scope():
        bn = SyncBatchNorm(3)
    strategy.run(lambda: None)  # components exist
    x = torch.randn(10, 3) * 2 + 1
    with strategy.scope():  # cross-replica context
        torch.testing.assert_close(bn(x), reference(x))
    torch.testing.assert_close(bn(x + 1), reference(x + 1))  # outside the scope
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        for component in getattr(bn, name).components:
            torch.testing.assert_close(component, getattr(reference, name))


def test_double_precision_and_half_inputs(make_mirrored):
    strategy = make_mirrored(2)
    reference = nn.BatchNorm1d(3).double()
    with strategy.scope():
        bn = SyncBatchNorm(3, dtype=torch.float64)
    x = torch.randn(8, 3, dtype=torch.float64)
    (xb,) = list(strategy.experimental_distribute_dataset([x]))
    out = strategy.gather(strategy.run(bn, args=(xb,)), axis=0)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(x))

    with strategy.scope():
        half = SyncBatchNorm(3)
    (hb,) = list(strategy.experimental_distribute_dataset([x.to(torch.bfloat16)]))
    out = strategy.gather(strategy.run(half, args=(hb,)), axis=0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), nn.BatchNorm1d(3).double()(x), rtol=2e-2, atol=2e-2)


def test_bad_inputs_are_rejected(make_mirrored):
    bn = SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"expects inputs of shape \(N, C, \.\.\.\)"):
        bn(torch.randn(3))
    strategy = make_mirrored(2)
    with strategy.scope():
        in_scope = SyncBatchNorm(3)
    (x,) = list(strategy.experimental_distribute_dataset([torch.randn(4, 5)]))
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(3\) expects 3 channels"):
        strategy.run(in_scope, args=(x,))


def test_convert_replaces_every_batchnorm_and_keeps_its_state(make_mirrored):
    model = nn.Sequential(
        nn.Conv2d(2, 3, 1),
        nn.BatchNorm2d(3, momentum=0.2, eps=1e-3),
        nn.Sequential(nn.Flatten(), nn.BatchNorm1d(12, affine=False), nn.Linear(12, 4)),
        nn.SyncBatchNorm(4),  # torch's own SyncBatchNorm is a _BatchNorm too
    )
    model(torch.randn(4, 2, 2, 2))  # running statistics that are not the defaults
    model[1].weight.requires_grad_(False)
    model.eval()
    model[2][1].train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[1].weight
    strategy = make_mirrored(2)
    with strategy.scope():
        converted = SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model
    layers = [converted[1], converted[2][1], converted[3]]
    assert all(type(layer) is SyncBatchNorm for layer in layers)
    assert (layers[0].momentum, layers[0].eps, layers[1].affine) == (0.2, 1e-3, False)
    assert [layer.training for layer in layers] == [False, True, False]
    assert not layers[0].weight.requires_grad
    assert layers[0].weight.primary.data_ptr() == weight.data_ptr()  # took over, not re-initialised
    assert isinstance(layers[0].weight, phalanx.MirroredVariable)  # built outside, distributed now
    assert isinstance(layers[0].running_var, phalanx.SyncOnReadVariable)
    for key, value in converted.state_dict().items():
        torch.testing.assert_close(value, state[key], msg=key)
    bn = nn.BatchNorm1d(2)
    bn.qconfig = "marker"
    single = SyncBatchNorm.convert_sync_batchnorm(bn)
    assert type(single) is SyncBatchNorm
    assert single.qconfig == "marker"
    assert single.weight is bn.weight
    already = SyncBatchNorm(2)
    assert SyncBatchNorm.convert_sync_batchnorm(already) is already


def test_convert_of_a_model_built_in_scope_keeps_its_variables(make_mirrored):
    strategy = make_mirrored(2)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        weight, running_mean = model[1].weight, model[1].running_mean
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model = SyncBatchNorm.convert_sync_batchnorm(model)
    assert model[1].weight is weight  # an optimizer made before the conversion still applies
    assert model[1].running_mean is running_mean
    assert optimizer.param_groups[0]["params"][2] is model[1].weight


def test_convert_rejects_an_uninitialised_lazy_layer():
    with pytest.raises(ValueError, match="uninitialised lazy layer"):
        SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()))
