"""``strategy.no_sync()`` under the in-process strategies: accumulate-only backward passes keep
each replica's gradients local, the next pass sums everything once, and the misuses raise.
The multi-worker strategies and ``fit`` are covered by tests/multiprocess/test_gradient_accumulation.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import phalanx
from phalanx.keras._accumulation import check_steps, check_strategy

STRATEGIES = ["one_device", "mirrored_2cpu", "central_storage_2cpu"]


def _replica_rows(strategy: phalanx.Strategy, t: torch.Tensor):
    """Each replica's rows of ``t`` (split in replica order)."""
    per = len(t) // strategy.num_replicas_in_sync
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: t[ctx.replica_id_in_sync_group * per : (ctx.replica_id_in_sync_group + 1) * per]
    )


def _grads(strategy: phalanx.Strategy, model: nn.Module, x: torch.Tensor, quiet: bool) -> list[torch.Tensor]:
    """Each replica's ``.grad`` of the weight after one backward pass of ``x`` (sum of squares)."""

    def step(xb: torch.Tensor) -> torch.Tensor:
        model(xb).pow(2).sum().backward()
        return model.weight.grad.clone()

    with strategy.no_sync() if quiet else contextlib.nullcontext():
        out = strategy.run(step, args=(_replica_rows(strategy, x),))
    return list(strategy.experimental_local_results(out))


def _local(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gradient of sum((x @ w.T)^2) with respect to w, on plain tensors."""
    w = weight.detach().clone().requires_grad_(True)
    (x @ w.T).pow(2).sum().backward()
    assert w.grad is not None
    return w.grad


@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_accumulate_only_passes_keep_each_replicas_gradient_local_and_the_next_pass_sums_all(runner):
    strategy = runner.strategy
    n = strategy.num_replicas_in_sync
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2 * n, 3, generator=gen) for _ in range(3)]
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Linear(3, 2, bias=False)
    weight = model.weight.detach().clone()
    rows = [[x[r * 2 : (r + 1) * 2] for x in xs] for r in range(n)]  # replica -> its rows of each pass

    first = _grads(strategy, model, xs[0], quiet=True)
    second = _grads(strategy, model, xs[1], quiet=True)
    last = _grads(strategy, model, xs[2], quiet=False)
    for r in range(n):  # no replica saw another's gradient before the synchronised pass
        torch.testing.assert_close(first[r], _local(rows[r][0], weight))
        torch.testing.assert_close(second[r], _local(rows[r][0], weight) + _local(rows[r][1], weight))
    if n > 1:
        assert not torch.allclose(first[0], first[1])
    total = sum(_local(x, weight) for x in xs)
    for grad in last:  # every replica: the sum of all three passes of all replicas, once
        torch.testing.assert_close(grad, total)


@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_a_parameter_only_the_accumulate_only_passes_reached_is_summed_by_the_next_pass(runner):
    strategy = runner.strategy
    n = strategy.num_replicas_in_sync
    x = torch.arange(4.0 * n).reshape(2 * n, 2) / 10
    with strategy.scope():
        torch.manual_seed(0)
        early, late = nn.Linear(2, 1, bias=False), nn.Linear(2, 1, bias=False)
    want = _local(x, early.weight)

    def step(xb: torch.Tensor, use_early: bool) -> torch.Tensor:
        (early if use_early else late)(xb).pow(2).sum().backward()
        return early.weight.grad.clone()

    with strategy.no_sync():
        strategy.run(step, args=(_replica_rows(strategy, x), True))
    out = strategy.run(step, args=(_replica_rows(strategy, x), False))
    for grad in strategy.experimental_local_results(out):
        torch.testing.assert_close(grad, want)


def test_no_sync_inside_run_is_refused(mirrored_2cpu):
    def step() -> None:
        with mirrored_2cpu.no_sync():
            pass

    with pytest.raises(RuntimeError, match=r"no_sync\(\) must be entered around strategy.run"):
        mirrored_2cpu.run(step)


@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_optimizer_step_inside_no_sync_is_refused(runner):
    strategy = runner.strategy
    with strategy.scope():
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()

    with strategy.no_sync(), pytest.raises(RuntimeError, match=r"optimizer.step\(\) ran inside .*no_sync"):
        strategy.run(step)


def test_a_step_after_accumulate_only_passes_alone_is_refused(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mirrored_2cpu.no_sync():
        mirrored_2cpu.run(lambda: model(torch.ones(1, 2)).sum().backward())
    with pytest.raises(RuntimeError, match="no backward pass outside it has summed"):
        mirrored_2cpu.run(opt.step)


def test_a_pass_that_raised_inside_no_sync_gives_its_gradients_back(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model = nn.Linear(2, 1, bias=False)

    def fails() -> None:
        out = model(torch.ones(1, 2)).sum()
        out.register_hook(lambda g: (_ for _ in ()).throw(ValueError("boom")))
        out.backward()

    with mirrored_2cpu.no_sync(), pytest.raises(ValueError, match="boom"):
        mirrored_2cpu.run(fails)
    out = mirrored_2cpu.run(lambda: (model(torch.ones(1, 2)).sum().backward(), model.weight.grad.clone())[1])
    for grad in mirrored_2cpu.experimental_local_results(out):
        torch.testing.assert_close(grad, torch.full((1, 2), 2.0))  # both replicas' ones, nothing else


@pytest.mark.parametrize("value", [0, -3])
def test_gradient_accumulation_steps_below_one_is_refused(value):
    with pytest.raises(ValueError, match=f"at least 1.*Received: {value}"):
        check_steps(value)


@pytest.mark.parametrize("value", [2.0, "4", True])
def test_gradient_accumulation_steps_that_is_not_an_int_is_refused(value):
    with pytest.raises(TypeError, match="must be an int"):
        check_steps(value)


def test_compile_refuses_a_bad_gradient_accumulation_steps(one_device):
    with one_device.scope():
        model = phalanx.Model(nn.Linear(2, 1))
    with pytest.raises(ValueError, match="at least 1"):
        model.compile(optimizer="sgd", loss="mse", gradient_accumulation_steps=0)
    with pytest.raises(TypeError, match="must be an int"):
        model.compile(optimizer="sgd", loss="mse", gradient_accumulation_steps=1.5)  # type: ignore[arg-type]


def test_accumulation_under_a_strategy_that_schedules_steps_on_any_worker_is_refused():
    # ParameterServerStrategy's class attribute; its fit runs each step on whichever worker is free
    assert phalanx.ParameterServerStrategy.schedules_steps
    with pytest.raises(ValueError, match="consecutive steps on one worker"):
        check_strategy(4, SimpleNamespace(schedules_steps=True))
    check_strategy(1, SimpleNamespace(schedules_steps=True))  # no accumulation: fine


def test_accumulation_in_an_elastic_job_is_refused():
    with pytest.raises(ValueError, match="not supported in an elastic job"):
        check_strategy(2, SimpleNamespace(schedules_steps=False, membership=object()))
