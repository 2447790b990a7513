"""DDP's gradient contract under the in-process strategies.

Once ``loss.backward()`` has returned inside ``strategy.run``, every replica's ``.grad``
holds the gradient summed over all replicas (the loss divided by the global batch), so a
read, ``clip_grad_norm_`` or an in-place edit between backward and ``optimizer.step()``
acts on it and the step applies what ``.grad`` holds: the one-device update. The same
checks run on two worker processes in tests/multiprocess/test_gradient_contract.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.values import PerReplica

GLOBAL = 8
LR = 0.5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Two global batches (for two backward passes before one step): (2, 8, 4) and (2, 8, 2)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, GLOBAL, 4, generator=g), torch.randn(2, GLOBAL, 2, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _clip(model: nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def _halve(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad.mul_(0.5)


def _zero_first_layer(model: nn.Module) -> None:
    for p in model[0].parameters():
        p.grad.zero_()


EDITS = {"none": lambda model: None, "clip": _clip, "halve": _halve, "zero_first": _zero_first_layer}


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum() / GLOBAL  # TF's rule: divided by the global batch


def one_device(edit: str, passes: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Plain PyTorch on the whole batch: the gradients read after backward, the weights after."""
    xs, ys = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for k in range(passes):
        _loss(model, xs[k], ys[k]).backward()
    seen = [p.grad.clone() for p in model.parameters()]
    EDITS[edit](model)
    opt.step()
    return seen, [p.detach().clone() for p in model.parameters()]


def train(
    strategy: phalanx.Strategy, edit: str, passes: int
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """The same step inside ``strategy.run``, each replica on its slice of the global batch.

    Returns:
        Per local replica, the gradients it read after backward; the weights after the step.
    """
    xs, ys = _data()
    with strategy.scope():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    per = GLOBAL // strategy.num_replicas_in_sync

    def part(t: torch.Tensor):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: t[:, ctx.replica_id_in_sync_group * per : (ctx.replica_id_in_sync_group + 1) * per]
        )

    def step(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        for k in range(passes):
            _loss(model, x[k], y[k]).backward()
        seen = [p.grad.clone() for p in model.parameters()]
        EDITS[edit](model)
        opt.step()
        return seen

    out = strategy.run(step, args=(part(xs), part(ys)))  # per parameter: a per-replica value
    per_param = [strategy.experimental_local_results(v) for v in out]
    seen = [list(replica) for replica in zip(*per_param, strict=True)]
    return seen, [p.detach().clone() for p in model.parameters()]


def check(result, edit: str, passes: int) -> None:
    seen, weights = result
    want_seen, want_weights = one_device(edit, passes)
    for replica in seen:
        for got, want in zip(replica, want_seen, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(weights, want_weights, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


STRATEGIES = ["one_device", "mirrored_2cpu", "central_storage_2cpu"]


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_grad_after_backward_is_the_sum_and_edits_before_the_step_apply(runner, edit, passes):
    (result,) = runner.run(train, edit, passes)
    check(result, edit, passes)


@pytest.mark.parametrize("edit", ["clip", "halve"])
def test_the_packed_path_keeps_the_contract(edit):
    # Custom cross-device ops cannot sum in place: each replica gets its own copy of the packed sum.
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=phalanx.ReductionToOneDevice())
    try:
        for passes in (1, 2):
            check(train(strategy, edit, passes), edit, passes)
    finally:
        strategy._threads.close()


def test_clipping_changes_the_update_compared_with_no_clipping():
    # guards the test above against an edit that does nothing
    assert not torch.allclose(one_device("clip", 1)[1][0], one_device("none", 1)[1][0])


def _two_layers(strategy):
    with strategy.scope():
        first, second = nn.Linear(3, 3), nn.Linear(3, 1)
        opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (first, second)]
    return first, second, opts


def test_two_optimizers_after_one_backward_both_apply_the_sum(mirrored_2cpu):
    first, second, opts = _two_layers(mirrored_2cpu)
    before = second.bias.detach().clone()
    x = PerReplica([torch.ones(1, 3), torch.ones(1, 3)])

    def step(x):
        second(first(x)).sum().backward()
        for opt in opts:
            opt.step()
        return second.bias.grad.clone()

    grads = mirrored_2cpu.run(step, args=(x,))
    assert [g.tolist() for g in grads.values] == [[2.0], [2.0]]  # d(sum)/d(bias) = 1 per replica
    torch.testing.assert_close(second.bias.detach(), before - 2.0)


def test_gradients_assigned_by_hand_are_summed_at_the_step(mirrored_2cpu):
    # as TF's apply_gradients: no backward ran since the optimizer's last step
    with mirrored_2cpu.scope():
        w = nn.Linear(1, 1, bias=False)
        opt = torch.optim.SGD(w.parameters(), lr=1.0)
    before = w.weight.detach().clone()

    def step():
        ctx = phalanx.get_replica_context()
        w.weight.grad = torch.full((1, 1), float(ctx.replica_id_in_sync_group + 1))
        opt.step()

    mirrored_2cpu.run(step)
    torch.testing.assert_close(w.weight.detach(), before - 3.0)


def test_autograd_grad_inside_run_leaves_grad_alone(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 1)
    x = PerReplica([torch.ones(1, 2), 2 * torch.ones(1, 2)])

    def step(x):
        layer(x).sum().backward()
        kept = layer.weight.grad.clone()
        (penalty,) = torch.autograd.grad(layer(x).sum(), [layer.weight])
        return kept, layer.weight.grad.clone(), penalty

    kept, after, penalty = mirrored_2cpu.run(step, args=(x,))
    for i in range(2):
        torch.testing.assert_close(kept.values[i], torch.full((1, 2), 3.0))  # 1 + 2, summed
        torch.testing.assert_close(after.values[i], kept.values[i])
        torch.testing.assert_close(penalty.values[i], torch.full((1, 2), float(i + 1)))  # its own


def test_backward_outside_run_sums_nothing_and_does_not_wait(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 1)
    mirrored_2cpu.run(lambda: None)
    layer(torch.ones(1, 2)).sum().backward()  # cross-replica context: replica 0's values
    torch.testing.assert_close(layer.weight.grad, torch.ones(1, 2))


def test_a_backward_that_raises_gives_the_gradients_back(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 1)
    x = PerReplica([torch.ones(1, 2), torch.ones(1, 2)])

    class Boom(Exception):
        pass

    def fail(grad):
        raise Boom("in backward")

    def step(x):
        layer(x).sum().backward()
        out = layer(x)
        out.register_hook(fail)
        (out.sum() + layer.bias.sum()).backward()  # the bias's hook runs before the failure

    with pytest.raises(Boom):
        mirrored_2cpu.run(step, args=(x,))
    for leaf in (layer.bias.replica_leaf(i) for i in range(2)):
        torch.testing.assert_close(leaf.grad, torch.full((1,), 2.0))  # the first pass's sum


@pytest.mark.parametrize("ops", [None, phalanx.ReductionToOneDevice()], ids=["in_place", "packed"])
def test_sparse_gradients_are_summed_on_both_paths(ops):
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
    try:
        with strategy.scope():
            torch.manual_seed(0)
            embed = nn.Embedding(6, 2, sparse=True)
        ids = PerReplica([torch.tensor([1, 2]), torch.tensor([2, 5])])

        def step(ids):
            embed(ids).sum().backward()
            return embed.weight.grad.to_dense()

        want = torch.zeros(6, 2)
        want[[1, 5]] = 1.0
        want[2] = 2.0
        for got in strategy.run(step, args=(ids,)).values:
            torch.testing.assert_close(got, want)
    finally:
        strategy._threads.close()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), True),  # left to torch: foreach
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False), False),  # the user's choice
        (lambda ps: torch.optim.NAdam(ps, lr=0.01), None),  # foreach differs in the last bits
    ],
    ids=["adamw", "sgd-chosen", "nadam"],
)
def test_several_replicas_update_with_foreach_kernels_only_where_numbers_stay(make, expected):
    def train(strategy):
        torch.manual_seed(0)
        with strategy.scope():
            model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
            optimizer = make(model.parameters())
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))

        def step():
            ctx = phalanx.get_replica_context()
            share = x[ctx.replica_id_in_sync_group :: ctx.num_replicas_in_sync]
            (model(share).pow(2).sum() / 8).backward()
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(4):
            strategy.run(step)
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        return optimizer.param_groups[0]["foreach"], weights

    mirrored = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        foreach, got = train(mirrored)
    finally:
        mirrored._threads.close()
    _, want = train(phalanx.OneDeviceStrategy("cpu"))
    assert foreach is expected
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # two replicas' sums vs one
