"""ReplicaContext: identity, merge_call, and the differentiable all_reduce / all_gather."""

from __future__ import annotations

import pytest
import torch

import phalanx


@pytest.fixture(params=[2, 4], ids=["2_replicas", "4_replicas"])
def mirrored(request):
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(request.param)])
    yield strategy
    strategy._threads.close()


def _ctx():
    return phalanx.get_replica_context()


def test_replica_identity(any_strategy):
    seen = {}

    def fn():
        ctx = _ctx()
        seen[ctx.replica_id_in_sync_group] = (ctx.num_replicas_in_sync, ctx.devices, ctx.strategy, repr(ctx))

    any_strategy.run(fn)
    n = any_strategy.num_replicas_in_sync
    assert sorted(seen) == list(range(n))
    for r, (count, devices, strategy, text) in seen.items():
        assert count == n
        assert len(devices) == 1
        assert devices[0].type == "cpu"
        assert strategy is any_strategy
        assert text == f"ReplicaContext(replica_id_in_sync_group={r}, num_replicas_in_sync={n})"


def test_merge_call_runs_once_with_regrouped_args_and_returns_each_replica_its_part(mirrored):
    calls = []

    def merge_fn(strategy, value, *, scale, tag):
        calls.append((phalanx.in_cross_replica_context(), phalanx.get_replica_context()))
        assert strategy is mirrored
        assert tag == "same"  # identical on every replica: plain
        locals_ = strategy.experimental_local_results(value)
        total = strategy.reduce("sum", value, axis=None)
        # a PerReplica result hands each replica its own component
        return phalanx.PerReplica([total * s for s in strategy.experimental_local_results(scale)]), locals_

    def fn():
        r = _ctx().replica_id_in_sync_group
        return _ctx().merge_call(
            merge_fn, args=(torch.tensor(float(r)),), kwargs={"scale": r + 1, "tag": "same"}
        )

    out = mirrored.run(fn)
    n = mirrored.num_replicas_in_sync
    assert calls == [(True, None)]  # once, in cross-replica context
    scaled, locals_ = out
    total = sum(range(n))
    assert [t.item() for t in mirrored.experimental_local_results(scaled)] == [
        total * (r + 1) for r in range(n)
    ]
    assert [t.item() for t in locals_] == list(range(n))


def test_merge_call_args_must_be_a_sequence(mirrored_2cpu):
    with pytest.raises(TypeError, match="merge_call args must be a tuple or list"):
        mirrored_2cpu.run(lambda: _ctx().merge_call(lambda s: None, args=3))


@pytest.mark.parametrize("op", ["sum", "mean", phalanx.ReduceOp.SUM, phalanx.ReduceOp.MEAN])
def test_all_reduce_of_tensors_and_nests(mirrored, op):
    n = mirrored.num_replicas_in_sync
    mean = phalanx.ReduceOp.coerce(op) is phalanx.ReduceOp.MEAN

    def fn():
        r = float(_ctx().replica_id_in_sync_group)
        return _ctx().all_reduce(op, {"t": torch.tensor([r, 1.0]), "nest": [torch.full((2, 2), r), (r, 2.0)]})

    out = mirrored.run(fn)  # one dict whose leaves are PerReplica values
    assert isinstance(out, dict)
    total = float(sum(range(n)))
    expect_t = torch.tensor([total, float(n)]) / (n if mean else 1)
    for t in mirrored.experimental_local_results(out["t"]):
        torch.testing.assert_close(t, expect_t)
    for t in mirrored.experimental_local_results(out["nest"][0]):
        torch.testing.assert_close(t, torch.full((2, 2), total / (n if mean else 1)))
    for t in mirrored.experimental_local_results(out["nest"][1][1]):  # python numbers become tensors
        assert t.item() == pytest.approx(2.0 * n / (n if mean else 1))


def test_all_reduce_mean_of_integers_floors(mirrored_2cpu):
    out = mirrored_2cpu.run(
        lambda: _ctx().all_reduce("mean", torch.tensor(3 + _ctx().replica_id_in_sync_group))
    )
    assert [t.item() for t in mirrored_2cpu.experimental_local_results(out)] == [3, 3]  # (3 + 4) // 2


def _replica_inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, generator=g) for _ in range(n)], [torch.randn(3, generator=g) for _ in range(n)]


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_gradient_matches_the_single_device_computation(mirrored, op):
    """Replica r computes loss_r = <w_r, tanh(all_reduce(x_r ** 2))>; the gradient each replica
    gets for x_r must be d(sum_q loss_q)/d x_r, as one device computing everything would get."""
    n = mirrored.num_replicas_in_sync
    xs, ws = _replica_inputs(n)

    # one device
    leaves = [x.clone().requires_grad_() for x in xs]
    reduced = torch.stack([x**2 for x in leaves]).sum(0) / (n if op == "mean" else 1)
    sum(torch.dot(w, torch.tanh(reduced)) for w in ws).backward()
    expected = [leaf.grad for leaf in leaves]

    def fn():
        r = _ctx().replica_id_in_sync_group
        x = xs[r].clone().requires_grad_()
        y = _ctx().all_reduce(op, x**2)
        torch.dot(ws[r], torch.tanh(y)).backward()
        return x.grad

    grads = mirrored.experimental_local_results(mirrored.run(fn))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_all_reduce_of_a_nest_is_differentiable_in_every_leaf(mirrored_2cpu):
    xs, ws = _replica_inputs(2, seed=1)

    def fn():
        r = _ctx().replica_id_in_sync_group
        a, b = xs[r].clone().requires_grad_(), ws[r].clone().requires_grad_()
        out = _ctx().all_reduce("sum", {"a": a * 2, "b": [b.sum()]})
        (out["a"] * out["b"][0]).sum().backward()
        return a.grad, b.grad

    a_grads, b_grads = (mirrored_2cpu.experimental_local_results(v) for v in mirrored_2cpu.run(fn))
    # L = sum_q <sum_r 2 a_r, 1> * (sum_r sum(b_r)) summed over 2 replicas
    sum_a, sum_b = 2 * (xs[0] + xs[1]).sum(), ws[0].sum() + ws[1].sum()
    for r in range(2):
        torch.testing.assert_close(a_grads[r], torch.full((3,), 2 * 2 * sum_b.item()))
        torch.testing.assert_close(b_grads[r], torch.full((3,), 2 * sum_a.item()))


@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_with_uneven_sizes_and_its_gradient(mirrored, axis):
    n = mirrored.num_replicas_in_sync
    g = torch.Generator().manual_seed(2)
    sizes = [r % 3 for r in range(n)]  # 0, 1, 2, 0: uneven, some empty
    shape = (lambda s: (s, 2)) if axis == 0 else (lambda s: (2, s))
    xs = [torch.randn(*shape(s), generator=g) for s in sizes]
    total = sum(sizes)
    ws = [torch.randn(*shape(total), generator=g) for _ in range(n)]

    leaves = [x.clone().requires_grad_() for x in xs]
    gathered = torch.cat(leaves, dim=axis)
    sum((w * torch.sin(gathered)).sum() for w in ws).backward()

    def fn():
        r = _ctx().replica_id_in_sync_group
        x = xs[r].clone().requires_grad_()
        out = _ctx().all_gather(x, axis=axis)
        (ws[r] * torch.sin(out)).sum().backward()
        return out.detach(), x.grad

    outs, grads = (mirrored.experimental_local_results(v) for v in mirrored.run(fn))
    for out in outs:
        torch.testing.assert_close(out, gathered.detach())
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad)


def test_all_gather_of_nests_and_scalars(mirrored_2cpu):
    def fn():
        r = _ctx().replica_id_in_sync_group
        return _ctx().all_gather({"s": torch.tensor(float(r)), "v": [torch.full((r + 1,), r)]}, axis=0)

    out = mirrored_2cpu.run(fn)
    for s in mirrored_2cpu.experimental_local_results(out["s"]):
        torch.testing.assert_close(s, torch.tensor([0.0, 1.0]))
    for v in mirrored_2cpu.experimental_local_results(out["v"][0]):
        torch.testing.assert_close(v, torch.tensor([0, 1, 1]))


def test_collectives_with_one_replica_return_their_input(one_device):
    x = torch.ones(2)
    assert one_device.run(lambda: _ctx().all_reduce("sum", x)) is x
    torch.testing.assert_close(one_device.run(lambda: _ctx().all_gather(x, axis=0)), x)
    assert one_device.run(lambda: _ctx().merge_call(lambda s, v: v + 1, args=(1,))) == 2
