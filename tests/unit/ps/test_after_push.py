"""A push returns no values; a worker reads pushed variables again only if the function uses
them after the step (phalanx.ps.worker.after_push), on an in-process cluster (real gRPC)."""

from __future__ import annotations

import torch

from phalanx.coordinator import ClusterCoordinator
from phalanx.ps.variables import PSClient


def _make():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _step(model, optimizer, x):
    optimizer.zero_grad()
    model(x).pow(2).sum().backward()
    optimizer.step()


def _counting(monkeypatch):
    calls = {"read_changed": 0, "return_values": []}
    read_changed, apply_gradients = PSClient.read_changed, PSClient.apply_gradients

    def counted_read(self, handles, known):
        calls["read_changed"] += 1
        return read_changed(self, handles, known)

    def counted_apply(self, key, handles, grads, hyper, return_values=True):
        calls["return_values"].append(return_values)
        return apply_gradients(self, key, handles, grads, hyper, return_values)

    monkeypatch.setattr(PSClient, "read_changed", counted_read)
    monkeypatch.setattr(PSClient, "apply_gradients", counted_apply)
    return calls


def test_values_used_after_the_step_are_the_updated_ones(ps_1worker_2ps, monkeypatch):
    x = torch.ones(4, 3)
    local = _make()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    _step(local, local_opt, x)
    expected = (local.weight.detach().clone(), local(x).detach(), local.bias.detach() * 2)
    strategy = ps_1worker_2ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = _make()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_then_use():
        _step(model, optimizer, x)
        return model.weight, model(x), model.bias * 2  # the variable itself, a forward, an op

    calls = _counting(monkeypatch)
    result = coordinator.schedule(step_then_use).fetch()
    for ours, theirs in zip(result, expected, strict=True):
        torch.testing.assert_close(torch.as_tensor(ours), theirs)  # fetch() gives numpy
    assert calls["return_values"] == [False]  # the push sent nothing back
    assert calls["read_changed"] == 2  # before the function, and once after its push


def test_a_function_that_only_returns_its_loss_reads_nothing_after_the_push(ps_1worker_2ps, monkeypatch):
    x = torch.ones(4, 3)
    strategy = ps_1worker_2ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = _make()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        optimizer.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        optimizer.step()
        return loss.detach()

    calls = _counting(monkeypatch)
    coordinator.schedule(step).fetch()
    assert calls["read_changed"] == 1  # before the function only
    coordinator.schedule(step).fetch()
    assert calls["read_changed"] == 2  # the next function reads what the push changed
    coordinator.join()  # the chief's copies are refreshed after a join
    local = _make()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for _ in range(2):
        _step(local, local_opt, x)
    torch.testing.assert_close(model.weight, local.weight)


def test_two_steps_in_one_function_train_like_two_local_steps(ps_1worker_2ps):
    xs = torch.randn(3, 4, 3, generator=torch.Generator().manual_seed(1))
    local = _make()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.1)
    for x in xs:
        _step(local, local_opt, x)
    strategy = ps_1worker_2ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = _make()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)

    def steps():
        for x in xs:  # each forward after the first reads what the push before it changed
            _step(model, optimizer, x)

    coordinator.schedule(steps)
    coordinator.join()
    torch.testing.assert_close(model.weight, local.weight)
    torch.testing.assert_close(model.bias, local.bias)


def test_phalanx_reads_and_pushes_are_outside_the_mode():
    """A worker's own reads and pushes (wire packing, sparse gradients) do not pass through
    ``AfterPush.__torch_function__``: they never read a pending variable's values."""
    from phalanx.ps.worker.after_push import AfterPush

    seen = []
    mode = AfterPush(lambda names: seen.append(list(names)))
    w = torch.zeros(2)
    mode.add({"w": w})  # pending: a torch operation that takes it reads it first
    try:
        with AfterPush.outside():
            w.add(1)
        assert seen == []
        w.add(1)
        assert seen == [["w"]]
    finally:
        mode.finish()


def test_a_pending_variable_inside_a_list_argument_is_read_first():
    """``torch.cat([x, w])``: the mode looks into the lists and tuples an operation takes."""
    from phalanx.ps.worker.after_push import AfterPush

    seen = []
    mode = AfterPush(lambda names: seen.append(list(names)))
    w = torch.zeros(2)
    mode.add({"w": w})
    try:
        torch.cat([torch.ones(2), torch.ones(1)])
        torch.stack((torch.ones(2),))
        assert seen == []
        torch.cat([torch.ones(2), w])
        assert seen == [["w"]]
    finally:
        mode.finish()


def test_the_mode_leaves_the_stack_once_nothing_is_pending():
    """After the lookup took the pending variables, the rest of the function's operations
    skip ``__torch_function__``; a later push enters the mode again. Inside its own handler
    (a flush) or below another mode it stays, and `finish` leaves it."""
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    from phalanx.ps.worker.after_push import AfterPush

    seen = []
    mode = AfterPush(lambda names: seen.append(list(names)))
    w = torch.zeros(2)
    try:
        mode.add({"w": w})
        assert _get_current_function_mode_stack() == [mode]
        assert mode.take() == ["w"]
        assert _get_current_function_mode_stack() == []
        mode.add({"w": w})  # pushed again
        assert mode.active
        assert _get_current_function_mode_stack() == [mode]
        w.add(1)  # flushed from inside the handler: the mode stays for its caller
        assert seen == [["w"]]
        assert _get_current_function_mode_stack() == [mode]
        with TorchFunctionMode() as inner:
            mode.add({"w": w})
            assert mode.take() == ["w"]
            assert _get_current_function_mode_stack() == [mode, inner]
    finally:
        mode.finish()
    assert _get_current_function_mode_stack() == []
