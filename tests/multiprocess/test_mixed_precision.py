"""Loss scaling under MultiWorkerMirroredStrategy on two worker processes.

An inf on one replica of one worker skips the step on every replica of every worker and
halves the scale everywhere; without one, training equals one device's. One local replica
per worker with torch's own ``torch.amp.GradScaler`` (as under DDP) and with phalanx's;
two local replicas with phalanx's `GradScaler`, torch's (adopted per replica) and
`LossScaleOptimizer`. The steps are those
of tests/unit/mixed_precision/test_loss_scale.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import phalanx

pytestmark = pytest.mark.multiprocess

_UNIT = Path(__file__).parents[1] / "unit" / "mixed_precision" / "test_loss_scale.py"


def _steps():
    spec = importlib.util.spec_from_file_location("loss_scale_steps", _UNIT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_and_poisoned(strategy, wrapper):
    """On every worker: a clean run, and one where the last replica of the job overflows at step 1."""
    steps = _steps()
    last = strategy.num_replicas_in_sync - 1
    return steps.train(strategy, wrapper, None), steps.train(strategy, wrapper, 1, last)


@pytest.mark.parametrize(
    ("devices", "wrapper"),
    [
        (["cpu:0"], "torch"),
        (["cpu:0"], "scaler"),
        (["cpu:0", "cpu:1"], "scaler"),
        (["cpu:0", "cpu:1"], "torch"),
        (["cpu:0", "cpu:1"], "optimizer"),
    ],
    ids=["1replica-torch", "1replica-phalanx", "2replicas-phalanx", "2replicas-torch", "2replicas-optimizer"],
)
def test_an_overflow_on_one_replica_of_one_worker_skips_the_step_everywhere(mwms_2workers, devices, wrapper):
    env = {"PHALANX_SHARED_MEMORY": "0"} if wrapper == "optimizer" else None  # both transports
    results = mwms_2workers.run(clean_and_poisoned, wrapper, strategy_kwargs={"devices": devices}, env=env)
    steps = _steps()
    want = steps.train(phalanx.OneDeviceStrategy("cpu"), "scaler" if wrapper == "torch" else wrapper, None)
    for clean, poisoned in results:
        for (weights, scales), (want_weights, _) in zip(clean, want, strict=True):
            torch.testing.assert_close(weights, want_weights, rtol=1e-3, atol=1e-4)
            assert set(scales) == {256.0}
        (w0, s0), (w1, s1), (w2, s2) = poisoned
        torch.testing.assert_close(w1, w0, rtol=0, atol=0)  # skipped on this worker too
        assert (set(s0), set(s1), set(s2)) == ({256.0}, {128.0}, {128.0})
        assert not torch.equal(w2, w1)
    torch.testing.assert_close(results[0][1][2][0], results[1][1][2][0], rtol=0, atol=0)


def scales_under_ps(strategy, wrapper):
    """Six steps scheduled one at a time; a worker's first step overflows (its scale is
    still the initial 256). Returns each step's (scale after it, whether it applied) and
    whether the weights moved."""
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrapper == "optimizer":
        scaling = phalanx.mixed_precision.LossScaleOptimizer(opt, initial_scale=256.0)
    else:
        scaling = torch.amp.GradScaler("cpu", init_scale=256.0)
    x, y = torch.ones(4, 3), torch.zeros(4, 1)
    before = model.weight.detach().clone()

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x).float() - y) ** 2).sum() / 4
        if wrapper == "optimizer":
            if scaling.loss_scale >= 256:
                loss = loss * float("inf")
            scaling.get_scaled_loss(loss).backward()
            applied = scaling.step()
            scaling.zero_grad()
            return scaling.loss_scale, applied
        if scaling.get_scale() >= 256:
            loss = loss * float("inf")
        scaling.scale(loss).backward()
        old = scaling.get_scale()
        scaling.step(opt)
        scaling.update()
        opt.zero_grad()
        return scaling.get_scale(), scaling.get_scale() == old

    coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
    history = []
    for _ in range(6):
        result = coordinator.schedule(step)
        coordinator.join()
        history.append(result.fetch())
    return history, not torch.equal(model.weight.detach(), before)


@pytest.mark.parametrize("wrapper", ["torch", "optimizer"])
def test_each_parameter_server_worker_keeps_its_own_loss_scale(ps_2workers_1ps, wrapper):
    ((history, moved),) = ps_2workers_1ps.run(scales_under_ps, wrapper)
    # each worker overflows once, at its first step, and keeps the halved scale after it
    # (before: every function got the chief's scaler afresh, overflowed and was skipped)
    assert [scale for scale, _ in history] == [128.0] * 6, history
    assert sum(not applied for _, applied in history) <= 2, history
    assert moved
