"""Optimizers created in a scope: per-replica state, plain state dicts, schedulers, misuse."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
}
STEPS = 3
BATCH = 5


def _model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    g = torch.Generator().manual_seed(seed + 1)
    return model, [
        (torch.randn(BATCH, 3, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(STEPS)
    ]


def _step_fn(model, optimizer):
    def step(x, y):
        # (an explicit global batch size: these tests hold several distributed batches at once)
        loss = phalanx.compute_average_loss(((model(x) - y) ** 2).squeeze(-1), global_batch_size=BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_replica_keeps_its_own_optimizer_state(mirrored_2cpu, name):
    with mirrored_2cpu.scope():
        model, data = _model_and_data()
        optimizer = OPTIMIZERS[name](model.parameters())
    step = _step_fn(model, optimizer)
    for batch in mirrored_2cpu.experimental_distribute_dataset(data):
        mirrored_2cpu.run(step, args=batch)
    states = [optimizer.state.replica_state(i) for i in range(2)]
    for p in model.parameters():
        first, second = states[0][p], states[1][p]
        assert first.keys() == second.keys()
        assert first.keys()  # every optimizer here keeps state
        for key, value in first.items():
            if key == "step":  # counted once per step by each replica, not once per replica
                assert float(value) == STEPS
                assert float(second[key]) == STEPS
            if isinstance(value, torch.Tensor):
                assert value.data_ptr() != second[key].data_ptr()  # not shared between replicas
            torch.testing.assert_close(second[key], value, msg=key)  # but equal: same updates


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_dict_outside_run_continues_in_plain_torch(mirrored_2cpu, name):
    with mirrored_2cpu.scope():
        model, data = _model_and_data()
        optimizer = OPTIMIZERS[name](model.parameters())
    batches = list(mirrored_2cpu.experimental_distribute_dataset(data + data[:1]))
    step = _step_fn(model, optimizer)
    for batch in batches[:STEPS]:
        mirrored_2cpu.run(step, args=batch)
    state = copy.deepcopy(optimizer.state_dict())  # (torch's state dicts share the live tensors)
    for entry in state["state"].values():
        assert all(type(v) is torch.Tensor for v in entry.values() if isinstance(v, torch.Tensor))
    plain, _ = _model_and_data()
    plain.load_state_dict(model.state_dict())
    plain_optimizer = OPTIMIZERS[name](plain.parameters())
    plain_optimizer.load_state_dict(state)
    # one more step each: the plain continuation equals the distributed one
    mirrored_2cpu.run(step, args=batches[STEPS])
    x, y = data[0]
    plain_optimizer.zero_grad()
    (((plain(x) - y) ** 2).squeeze(-1).mean()).backward()
    plain_optimizer.step()
    for (key, value), plain_value in zip(
        model.state_dict().items(), plain.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(value, plain_value, rtol=1e-5, atol=1e-6, msg=key)


def test_loading_an_optimizer_state_dict_in_scope_reaches_every_replica(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model, data = _model_and_data()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    step = _step_fn(model, optimizer)
    batches = list(mirrored_2cpu.experimental_distribute_dataset(data))
    for batch in batches:
        mirrored_2cpu.run(step, args=batch)
    saved = copy.deepcopy(optimizer.state_dict())
    mirrored_2cpu.run(step, args=batches[0])  # now at step 4
    with mirrored_2cpu.scope():
        optimizer.load_state_dict(saved)  # back to step 3
    mirrored_2cpu.run(step, args=batches[1])
    weight = model[0].weight
    assert [float(optimizer.state.replica_state(i)[weight]["step"]) for i in range(2)] == [4.0, 4.0]


def test_lr_scheduler_steps_outside_run(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model, data = _model_and_data()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    step = _step_fn(model, optimizer)
    seen = []

    def step_and_record(x, y):
        seen.append(optimizer.param_groups[0]["lr"])
        return step(x, y)

    for batch in mirrored_2cpu.experimental_distribute_dataset(data):
        mirrored_2cpu.run(step_and_record, args=batch)
        scheduler.step()
    assert sorted(seen) == [0.2, 0.2, 0.4, 0.4, 0.8, 0.8]  # both replicas see each lr
    assert scheduler.get_last_lr() == [pytest.approx(0.1)]


def test_gradients_accumulated_over_several_runs_are_summed_once(mirrored_2cpu):
    def train(strategy):
        with strategy.scope():
            model, data = _model_and_data()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def accumulate(x, y):
            phalanx.compute_average_loss(((model(x) - y) ** 2).squeeze(-1), global_batch_size=15).backward()

        def apply():
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(data):
            strategy.run(accumulate, args=batch)
        strategy.run(apply)
        return model.state_dict()

    expected = train(phalanx.OneDeviceStrategy("cpu"))
    for key, value in train(mirrored_2cpu).items():
        torch.testing.assert_close(value, expected[key], msg=key)


def test_two_optimizers_over_disjoint_parameters(mirrored_2cpu):
    def train(strategy):
        with strategy.scope():
            model, data = _model_and_data()
            first = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.5)
            second = torch.optim.Adam(model[2].parameters(), lr=0.01)

        def step(x, y):
            phalanx.compute_average_loss(((model(x) - y) ** 2).squeeze(-1)).backward()
            first.step()
            second.step()
            first.zero_grad()
            second.zero_grad()

        for batch in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=batch)
        return model.state_dict()

    expected = train(phalanx.OneDeviceStrategy("cpu"))
    for key, value in train(mirrored_2cpu).items():
        torch.testing.assert_close(value, expected[key], msg=key)


def test_a_parameter_created_outside_the_scope_is_rejected_with_a_hint(mirrored_2cpu):
    outside = nn.Linear(2, 1)
    other = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with other.scope():
            foreign = nn.Linear(2, 1)
    finally:
        other._threads.close()
    for module in (outside, foreign):
        with mirrored_2cpu.scope():
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

        def step(module=module, optimizer=optimizer):
            module(torch.ones(1, 2)).sum().backward()
            optimizer.step()

        with pytest.raises(
            RuntimeError, match=r"not created in this strategy's scope.*HINT: create the model"
        ):
            mirrored_2cpu.run(step)


def test_central_storage_applies_each_update_once(central_storage_2cpu):
    with central_storage_2cpu.scope():
        model, data = _model_and_data()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    step = _step_fn(model, optimizer)
    for batch in central_storage_2cpu.experimental_distribute_dataset(data):
        central_storage_2cpu.run(step, args=batch)
    assert float(optimizer.state_dict()["state"][0]["step"]) == STEPS


def test_a_cross_replica_optimizer_step_is_refused_and_replicas_stay_equal(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model, data = _model_and_data()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = _step_fn(model, optimizer)
    batches = list(mirrored_2cpu.experimental_distribute_dataset(data))
    mirrored_2cpu.run(step, args=batches[0])
    x, y = data[1]
    ((model(x) - y) ** 2).mean().backward()  # a step outside run
    with pytest.raises(RuntimeError, match=r"outside .*\.run.*replicas would drift apart.*HINT: call"):
        optimizer.step()
    mirrored_2cpu.run(lambda: optimizer.zero_grad())
    mirrored_2cpu.run(step, args=batches[2])
    for p in model.parameters():
        torch.testing.assert_close(p.components[1], p.components[0])
