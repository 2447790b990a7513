"""The lean one-replica step: `run`, `reduce`, ``optimizer.step()`` and the distributed
iterator skip their bookkeeping when one replica is in the job, and give what the full path
gives. Every error the full path raises is still raised once the lean path is in use, and
what may change later (variables made, torch's hooks removed, an unusual batch) sends the
step back to the full path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import phalanx
from phalanx import _hooks, context
from phalanx.values import PerReplica
from phalanx.variables import DistributedVariable

ONE_REPLICA = ["default_strategy", "one_device"]


def _model_and_optimizer(strategy: phalanx.Strategy) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


def _batches(n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = phalanx.compute_average_loss(per_example)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def _warm(strategy: phalanx.Strategy) -> None:
    """One run, so the strategy has decided its path (the first run takes the full one)."""
    strategy.run(lambda: None)


@pytest.mark.parametrize("name", ONE_REPLICA)
def test_the_lean_loop_trains_as_the_plain_loop(name, request):
    strategy = request.getfixturevalue(name)
    model, optimizer = _model_and_optimizer(strategy)
    plain_model, plain_optimizer = _model_and_optimizer(phalanx.get_strategy())
    plain_step = _step(plain_model, plain_optimizer)
    step = _step(model, optimizer)
    for (x, y), (px, py) in zip(
        strategy.experimental_distribute_dataset(_batches()), _batches(), strict=True
    ):
        ours = strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)
        assert torch.equal(ours, plain_step(px, py))
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not phalanx.variables.in_optimizer_step()


@pytest.mark.parametrize("name", ONE_REPLICA)
def test_the_lean_run_still_refuses_what_the_full_run_refuses(name, request):
    strategy = request.getfixturevalue(name)
    _warm(strategy)
    x = torch.ones(4, 2)
    with pytest.raises(TypeError, match="needs a callable"):
        strategy.run(3, args=(x,))
    with pytest.raises(TypeError, match="as a tuple or list"):
        strategy.run(lambda t: t, args=x)
    with pytest.raises(ValueError, match="with 2 components"):
        strategy.run(lambda t: t, args=(PerReplica([x, x]),))
    other = phalanx.OneDeviceStrategy("cpu")
    with other.scope(), pytest.raises(RuntimeError, match="inside the scope of"):
        strategy.run(lambda t: t, args=(x,))
    if not strategy.is_default:  # the default strategy's run inside its run calls fn
        with pytest.raises(RuntimeError, match="inside a replica context"):
            strategy.run(lambda t: strategy.run(lambda u: u, args=(t,)), args=(x,))
        with pytest.raises(RuntimeError, match="inside strategy.run use"):
            strategy.run(lambda t: strategy.reduce("sum", t, axis=None), args=(x,))
    for op in ("max", ["sum"]):
        with pytest.raises(ValueError, match="reduce op must be"):
            strategy.reduce(op, x, axis=None)
    assert strategy.reduce(phalanx.ReduceOp.MEAN, x, axis=None) is x
    assert torch.equal(strategy.run(lambda t: t * 2, args=(x,)), x * 2)  # and it still runs
    assert strategy.run(lambda t, k=1: t * k, args=(x,), kwargs={"k": 3}).sum() == 24  # kwargs: full path


def test_an_optimizer_step_inside_no_sync_is_refused_on_the_lean_path(one_device):
    model, optimizer = _model_and_optimizer(one_device)
    step = _step(model, optimizer)
    x, y = _batches(1)[0]
    one_device.run(step, args=(x, y))
    with one_device.no_sync(), pytest.raises(RuntimeError, match=r"optimizer.step\(\) ran inside"):
        one_device.run(step, args=(x, y))
    with pytest.raises(RuntimeError, match="must be entered around strategy.run"):
        one_device.run(lambda: one_device.no_sync().__enter__())


def test_a_run_after_the_hooks_were_removed_installs_them_again(one_device):
    model, optimizer = _model_and_optimizer(one_device)
    step = _step(model, optimizer)
    x, y = _batches(1)[0]
    one_device.run(step, args=(x, y))
    phalanx.remove_torch_hooks()
    assert not _hooks.step_hooks_in_place
    one_device.run(step, args=(x, y))
    assert _hooks.step_hooks_in_place
    assert _hooks.installed()
    with one_device.no_sync(), pytest.raises(RuntimeError, match=r"optimizer.step\(\) ran inside"):
        one_device.run(step, args=(x, y))  # the hooks saw the step again


def test_variables_made_after_the_first_run_send_the_step_to_the_full_path():
    strategy = phalanx.MirroredStrategy(["cpu:0"])  # one replica, with distributed variables
    _warm(strategy)
    model, optimizer = _model_and_optimizer(strategy)
    assert isinstance(model[0].weight, DistributedVariable)
    plain_model, plain_optimizer = _model_and_optimizer(phalanx.get_strategy())
    step, plain_step = _step(model, optimizer), _step(plain_model, plain_optimizer)
    for x, y in _batches(3):
        assert torch.equal(strategy.run(step, args=(x, y)), plain_step(x, y))
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(torch.as_tensor(p), q)
    assert not phalanx.variables.in_optimizer_step()


def test_a_step_that_fails_inside_the_optimizer_leaves_no_step_flag_behind():
    strategy = phalanx.MirroredStrategy(["cpu:0"])
    _warm(strategy)
    model, optimizer = _model_and_optimizer(strategy)

    def failing_update(*args, **kwargs):
        raise RuntimeError("update failed")

    optimizer.register_step_post_hook(failing_update)
    x, y = _batches(1)[0]
    with pytest.raises(RuntimeError, match="update failed"):
        strategy.run(_step(model, optimizer), args=(x, y))
    assert not phalanx.variables.in_optimizer_step()


@pytest.mark.parametrize("name", ONE_REPLICA)
def test_the_lean_iterator_still_checks_and_converts_batches(name, request):
    strategy = request.getfixturevalue(name)
    x, y = torch.ones(4, 2), torch.zeros(4)
    batches = [
        (x, y),
        (np.ones((3, 2), dtype=np.float32), np.zeros(3)),  # converted, then the lean path again
        (x, y, None),
        {"x": x},
        (x, y),
    ]
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    got = list(iterator)
    assert len(got) == 5
    assert got[0][0] is x
    assert got[4][0] is x
    assert isinstance(got[1][0], torch.Tensor)
    assert got[1][0].shape == (3, 2)
    assert got[2][2] is None
    assert torch.equal(got[3]["x"], x)
    assert iterator.state_dict() == {"steps": 5}
    with pytest.raises(ValueError, match="same first dimension"):
        list(strategy.experimental_distribute_dataset([(x, y), (x, torch.zeros(3))]))
    with pytest.raises(ValueError, match="batch dimension"):
        list(strategy.experimental_distribute_dataset([(x, torch.tensor(1.0))]))


def test_a_replica_frame_is_pushed_at_the_top_only_outside_frames_or_in_its_strategys_scope(one_device):
    frame = context.Frame(one_device, one_device.replica_context(0))
    previous = context.push_replica_frame_at_top(frame, 0)
    assert previous is None
    assert context.current_replica() == (one_device, 0)
    assert context.push_replica_frame_at_top(frame, 0) is context.NOT_PUSHED  # inside a replica frame
    context.pop_replica_frame(previous)
    assert context.current_frame() is None
    with one_device.scope():
        previous = context.push_replica_frame_at_top(frame, 0)
        assert previous is None
        assert context.current_frame() is frame
        context.pop_replica_frame(previous)
    other = phalanx.OneDeviceStrategy("cpu")
    with other.scope():
        assert context.push_replica_frame_at_top(frame, 0) is context.NOT_PUSHED
        assert context.current_frame().strategy is other


@pytest.mark.parametrize("name", ONE_REPLICA)
def test_a_lean_run_starts_its_step_afresh(name, request):
    strategy = request.getfixturevalue(name)
    _warm(strategy)
    replica = strategy.replica_context(0)

    def facts() -> tuple[int, int | None, int]:
        ctx = phalanx.get_replica_context()
        return ctx.next_dropout_call(), ctx.global_batch_size, ctx.example_offset

    assert strategy.run(facts) == (0, None, 0)
    assert strategy.run(facts) == (0, None, 0)  # the last step's dropout call is not counted
    replica.next_dropout_call()  # as code outside any run may (the default strategy's context)
    replica.begin_step(8, 3)
    assert strategy.run(facts) == (0, None, 0)


def test_no_sync_is_seen_by_every_step_while_it_is_open_and_nested(one_device):
    model, optimizer = _model_and_optimizer(one_device)
    step = _step(model, optimizer)
    x, y = _batches(1)[0]
    one_device.run(step, args=(x, y))
    with one_device.no_sync():
        with one_device.no_sync(), pytest.raises(RuntimeError, match="no_sync"):
            one_device.run(step, args=(x, y))
        with pytest.raises(RuntimeError, match="no_sync"):
            one_device.run(step, args=(x, y))  # still inside the outer one
    one_device.run(step, args=(x, y))  # outside: steps again
