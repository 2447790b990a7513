"""Dynamic loss scaling inside strategy.run: GradScaler and LossScaleOptimizer.

Every replica finds the same overflow because ``.grad`` holds the sum over all replicas
once backward returns: an overflow on one replica skips the step on every replica and
lowers the scale everywhere. The same on two worker processes:
tests/multiprocess/test_mixed_precision.py.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import phalanx
from phalanx.mixed_precision import GradScaler, LossScaleOptimizer

GLOBAL = 4
STRATEGIES = ["one_device", "mirrored_2cpu", "central_storage_2cpu"]


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, GLOBAL, 3, generator=g), torch.randn(3, GLOBAL, 1, generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def train(strategy, wrapper: str, poison_step: int | None, poison_replica: int = -1):
    """Three steps of float16 autocast with loss scaling; at ``poison_step`` the replica with
    global id ``poison_replica`` makes an inf loss. Returns per step the weights and each
    local replica's loss scale."""
    xs, ys = _data()
    with strategy.scope():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrapper == "scaler":
        scaling: torch.amp.GradScaler | LossScaleOptimizer = GradScaler("cpu", init_scale=256.0)
    elif wrapper == "torch":  # torch's own: given per-replica state by the first replica's call
        scaling = torch.amp.GradScaler("cpu", init_scale=256.0)
    else:
        scaling = LossScaleOptimizer(opt, initial_scale=256.0)
    per = GLOBAL // strategy.num_replicas_in_sync

    def part(t, k):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: t[k, ctx.replica_id_in_sync_group * per : (ctx.replica_id_in_sync_group + 1) * per]
        )

    def step(x, y, poison):
        ctx = phalanx.get_replica_context()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = ((out.float() - y) ** 2).sum() / GLOBAL
        if poison and ctx.replica_id_in_sync_group == poison_replica:
            loss = loss * float("inf")
        if isinstance(scaling, torch.amp.GradScaler):
            scaling.scale(loss).backward()
            scaling.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # on the unscaled sum
            scaling.step(opt)
            scaling.update()
            opt.zero_grad()
            return scaling.get_scale()
        scaling.get_scaled_loss(loss).backward()
        scaling.step()
        scaling.zero_grad()
        return scaling.loss_scale

    history = []
    for k in range(3):
        scales = strategy.run(step, args=(part(xs, k), part(ys, k), k == poison_step))
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        history.append((weights, [float(s) for s in strategy.experimental_local_results(scales)]))
    return history


@pytest.mark.parametrize("wrapper", ["scaler", "torch", "optimizer"])
@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_loss_scaling_trains_as_on_one_device(runner, wrapper):
    (got,) = runner.run(train, wrapper, None)
    want = train(phalanx.OneDeviceStrategy("cpu"), wrapper, None)
    for (weights, scales), (want_weights, _) in zip(got, want, strict=True):
        torch.testing.assert_close(weights, want_weights, rtol=1e-3, atol=1e-4)  # float16 compute
        assert set(scales) == {256.0}


@pytest.mark.parametrize("wrapper", ["scaler", "torch", "optimizer"])
@pytest.mark.parametrize("runner", STRATEGIES, indirect=True)
def test_an_overflow_on_one_replica_skips_the_step_on_every_replica(runner, wrapper):
    (history,) = runner.run(train, wrapper, 1, runner.strategy.num_replicas_in_sync - 1)
    (w0, s0), (w1, s1), (w2, s2) = history
    torch.testing.assert_close(w1, w0, rtol=0, atol=0)  # the poisoned step was skipped
    assert set(s0) == {256.0}
    assert set(s1) == {128.0}  # halved on every replica
    assert set(s2) == {128.0}
    assert not torch.equal(w2, w1)  # training goes on


def test_each_replica_keeps_its_own_state_and_a_load_restarts_them_from_replica_0(mirrored_2cpu):
    scaler = GradScaler("cpu", init_scale=8.0)
    mirrored_2cpu.run(lambda: scaler.scale(torch.ones(())))
    assert sorted(scaler.__dict__["_replicas"]) == [0, 1]
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0})
    assert sorted(scaler.__dict__["_replicas"]) == [0]
    scales = mirrored_2cpu.run(lambda: scaler.scale(torch.ones(())))
    assert [float(s) for s in scales.values] == [2.0, 2.0]


class LoggingScaler(torch.amp.GradScaler):
    def __init__(self) -> None:
        super().__init__("cpu", init_scale=4.0)
        self.scaled = 0

    def scale(self, outputs):
        self.scaled += 1  # shared by the replicas: not per-replica state
        return super().scale(outputs)


def test_a_plain_torch_grad_scaler_is_adopted_only_inside_several_replicas(mirrored_2cpu):
    alone = torch.amp.GradScaler("cpu", init_scale=4.0)
    phalanx.OneDeviceStrategy("cpu").run(lambda: alone.scale(torch.ones(())))
    assert type(alone) is torch.amp.GradScaler  # one replica: torch's class untouched

    scaler = LoggingScaler()
    scaler.scale(torch.ones(()))  # outside run: replica 0's state from here on
    mirrored_2cpu.run(lambda: scaler.scale(torch.ones(())))
    assert isinstance(scaler, (GradScaler, LoggingScaler))
    assert scaler.scaled == 3  # the subclass's own override still runs
    assert sorted(scaler.__dict__["_replicas"]) == [0, 1]
    assert float(scaler.get_scale()) == 4.0


def test_an_adopted_scaler_pickles_as_the_users_class(mirrored_2cpu):
    plain, logging = torch.amp.GradScaler("cpu", init_scale=4.0), LoggingScaler()
    for scaler in (plain, logging):
        mirrored_2cpu.run(lambda s=scaler: s.scale(torch.ones(())))
    assert type(plain) is GradScaler  # torch's own class becomes phalanx's, an importable one
    copy = pickle.loads(pickle.dumps(logging))
    assert type(copy) is LoggingScaler
    assert copy.scaled == 2
    assert float(copy.get_scale()) == 4.0
    assert float(pickle.loads(pickle.dumps(plain)).get_scale()) == 4.0


def test_loss_scale_optimizer_refuses_a_non_optimizer():
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer. Received: Linear"):
        LossScaleOptimizer(nn.Linear(1, 1))
