"""The in-process gradient path (GradientSync) driven directly, with recording parts.

The path receives its devices, rendezvous, cross-device ops, cross-worker reduce and variable
policy as arguments; these tests hand it recording ones and check what it does with each.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch
from torch import nn

import phalanx
from phalanx.communication.local.cross_device_ops import CrossDeviceOps
from phalanx.strategies.replicas.gradients import GradientSync
from phalanx.strategies.replicas.optimizer_state import PerReplicaState
from phalanx.strategies.replicas.rendezvous import ReplicaRendezvous
from phalanx.strategies.replicas.variable_policy import VariablePolicy
from phalanx.values import ReduceOp
from phalanx.variables import in_optimizer_step


class RecordingOps(CrossDeviceOps):
    """Sums like the default ops and records every call; says what it is told about in-place sums."""

    def __init__(self, in_place: bool) -> None:
        self.in_place = in_place
        self.reduce_calls: list[int] = []
        self.asked: list[tuple[torch.device, ...]] = []

    def reduce_to(
        self, reduce_op: ReduceOp, tensors: Sequence[torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        self.reduce_calls.append(len(tensors))
        return torch.stack([t.to(device) for t in tensors]).sum(0)

    def can_sum_in_place(self, devices: Sequence[torch.device]) -> bool:
        self.asked.append(tuple(devices))
        return self.in_place


class RecordingRendezvous(ReplicaRendezvous):
    """The real meeting point, recording what each meeting was for."""

    def __init__(self, n: int) -> None:
        super().__init__(n, timeout=30.0)
        self.meetings: list[str] = []

    def exchange(self, index, value, leader_fn=None, what="a collective"):
        if index == 0:
            self.meetings.append(what)
        return super().exchange(index, value, leader_fn, what)


class RecordingPolicy(VariablePolicy):
    """The mirrored policy, counting the replicas that finished a step."""

    finished: list[int]

    def after_optimizer_step(self, index: int) -> None:
        self.finished.append(index)


@pytest.fixture
def model(mirrored_2cpu):
    torch.manual_seed(0)
    with mirrored_2cpu.scope():
        layer = nn.Linear(3, 2)
    mirrored_2cpu.run(lambda: None)  # makes replica 1's components
    for i in range(2):
        for p in layer.parameters():
            p.replica_leaf(i).grad = torch.full_like(p.replica_leaf(i), float(i + 1))
    return layer


def _path(strategy, ops, workers, reduce_log, policy=None):
    def cross_worker(tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        reduce_log.append(op)
        return tensor * workers  # as if every worker had the same local sum

    return GradientSync(
        devices=strategy.local_devices,
        rendezvous=RecordingRendezvous(2),
        cross_device_ops=ops,
        cross_worker_all_reduce=cross_worker,
        policy=policy or strategy.variable_policy,
        num_workers=lambda: workers,
    )


def _on_both_replicas(fn) -> None:
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # re-raised below, on the test's thread
            errors.append(exc)

    other = threading.Thread(target=call, args=(1,))
    other.start()
    call(0)
    other.join(timeout=30)
    if errors:
        raise errors[0]


def test_packed_path_sums_locally_then_across_workers_and_gives_each_replica_its_own_copy(
    mirrored_2cpu, model
):
    ops, reduced = RecordingOps(in_place=False), []
    path = _path(mirrored_2cpu, ops, workers=3, reduce_log=reduced)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> None:
        path.before_step(optimizer, i)
        assert in_optimizer_step()
        path.reset_thread()

    _on_both_replicas(step)
    assert ops.reduce_calls == [2]  # one packed float32 buffer, both replicas' packs
    # by the last replica to arrive: who has a gradient (agreed across workers), the sums
    assert reduced == [ReduceOp.SUM, ReduceOp.SUM]
    assert path._rendezvous.meetings == ["optimizer.step()"]
    for p in model.parameters():
        grads = [p.replica_leaf(i).grad for i in range(2)]
        for g in grads:
            torch.testing.assert_close(g, torch.full_like(g, (1.0 + 2.0) * 3))
        assert grads[0].data_ptr() != grads[1].data_ptr()
    assert isinstance(optimizer.state, PerReplicaState)
    assert optimizer.state.owner is mirrored_2cpu


def test_in_place_path_is_taken_only_when_the_ops_allow_it_and_one_worker_steps(mirrored_2cpu, model):
    ops, reduced = RecordingOps(in_place=True), []
    path = _path(mirrored_2cpu, ops, workers=1, reduce_log=reduced)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _on_both_replicas(lambda i: path.before_step(optimizer, i))
    assert ops.asked[0] == mirrored_2cpu.local_devices
    assert ops.reduce_calls == []  # summed slice by slice, no reduction
    assert reduced == []
    assert path._rendezvous.meetings == ["optimizer.step()", "optimizer.step() (gradient sum)"]
    for p in model.parameters():
        for i in range(2):
            torch.testing.assert_close(p.replica_leaf(i).grad, torch.full_like(p, 3.0))
    assert isinstance(optimizer.state, PerReplicaState)


def test_several_workers_never_sum_in_place(mirrored_2cpu, model):
    ops, reduced = RecordingOps(in_place=True), []
    path = _path(mirrored_2cpu, ops, workers=2, reduce_log=reduced)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _on_both_replicas(lambda i: path.before_step(optimizer, i))
    assert ops.reduce_calls == [2]
    assert reduced == [ReduceOp.SUM, ReduceOp.SUM]
    for p in model.parameters():
        torch.testing.assert_close(p.replica_leaf(1).grad, torch.full_like(p, 6.0))


def test_parameters_no_replica_has_a_gradient_for_stay_without_one(mirrored_2cpu, model):
    for i in range(2):
        model.bias.replica_leaf(i).grad = None
    path = _path(mirrored_2cpu, RecordingOps(in_place=False), workers=1, reduce_log=[])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _on_both_replicas(lambda i: path.before_step(optimizer, i))
    assert all(model.bias.replica_leaf(i).grad is None for i in range(2))
    assert all(model.weight.replica_leaf(i).grad is not None for i in range(2))


def test_after_step_ends_the_write_permission_and_lets_the_policy_finish(mirrored_2cpu, model):
    policy = RecordingPolicy(mirrored_2cpu, mirrored_2cpu.rendezvous, mirrored_2cpu.cross_device_ops)
    policy.finished = []
    for p in model.parameters():  # the recording policy has seen no variable of its own yet
        policy.register(p)
    path = _path(mirrored_2cpu, RecordingOps(in_place=False), workers=1, reduce_log=[], policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> None:
        path.before_step(optimizer, i)
        path.after_step(optimizer, i)
        assert not in_optimizer_step()

    _on_both_replicas(step)
    assert sorted(policy.finished) == [0, 1]


def test_a_parameter_of_another_strategy_is_refused_naming_the_owner(mirrored_2cpu, model):
    path = _path(mirrored_2cpu, RecordingOps(in_place=False), workers=1, reduce_log=[])
    stranger = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    with pytest.raises(
        RuntimeError, match=r"inside MirroredStrategy\(devices=\['cpu:0', 'cpu:1'\]\)\.run got a"
    ):
        path.before_step(optimizer, 0)


def test_a_strategys_step_goes_through_its_ops_reduce_when_they_cannot_sum_in_place():
    calls = []

    def accumulate(tensors):
        calls.append(len(tensors))
        return torch.stack(tensors).sum(0)

    ops = phalanx.ReductionToOneDevice(accumulation_fn=accumulate)
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
    try:
        with strategy.scope():
            layer = nn.Linear(2, 1)
            optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

        def step(x):
            layer(x).sum().backward()
            optimizer.step()

        strategy.run(step, args=(phalanx.values.PerReplica([torch.ones(1, 2), torch.ones(1, 2)]),))
        assert calls == [2]  # the packed float32 buffer, summed by the custom accumulation
        torch.testing.assert_close(layer.bias.components[0], layer.bias.components[1])
    finally:
        strategy._threads.close()
