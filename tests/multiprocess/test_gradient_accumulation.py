"""Gradient accumulation under every strategy: ``strategy.no_sync()`` in a custom loop and
``Model.compile(gradient_accumulation_steps=k)`` in ``fit``.

Four micro-batches of global batch 64, the first three inside ``no_sync()``, end at the
weights of one global batch of 256 (plain PyTorch on one device is the reference); under
MultiWorkerMirrored the accumulate-only passes move nothing, so the loop moves at most 0.4x
the collective bytes of four synchronised batches of 64 (counted at the worker group, which
every phalanx collective passes through). A parameter-server worker accumulates and pushes
once.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

import phalanx

MICRO, K, UPDATES = 64, 4, 2  # global batch of each step, steps per update, updates
TOL = {"rtol": 1e-5, "atol": 1e-7}
_MP = pytest.mark.multiprocess
RUNNERS = [
    "one_device",
    "mirrored_2cpu",
    pytest.param("mwms_2workers", marks=_MP),
    pytest.param("fsdp_2workers", marks=_MP),
]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _arrays() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    n = MICRO * K * UPDATES
    return torch.randn(n, 6, generator=gen), torch.randn(n, 2, generator=gen)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # momentum: the number of updates shows


def reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch on one device: UPDATES steps of global batch MICRO * K, mean squared error."""
    x, y = _arrays()
    model = _net()
    opt = _optimizer(model.parameters())
    big = MICRO * K
    for u in range(UPDATES):
        nn.functional.mse_loss(model(x[u * big : (u + 1) * big]), y[u * big : (u + 1) * big]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Collectives:
    """Counts the collectives of a worker group and their bytes (every phalanx collective
    is signed by the group's ``_sign`` before it starts)."""

    def __init__(self, strategy: phalanx.Strategy) -> None:
        self.calls, self.bytes = 0, 0
        group = getattr(strategy, "_group", None)
        if group is not None:
            sign = group._sign

            def counted(kind, tensor, what):
                self.calls += 1
                self.bytes += tensor.numel() * tensor.element_size()
                return sign(kind, tensor, what)

            group._sign = counted


def custom_loop(strategy: phalanx.Strategy, micro: int, k: int, use_no_sync: bool = True) -> dict:
    """(every worker) Steps of global batch ``micro``; every ``k``-th updates, the others run
    inside ``no_sync()`` (or not, ``use_no_sync=False``: every pass sums, the step still waits)."""
    x, y = _arrays()
    with strategy.scope():
        model = _net()
        opt = _optimizer(model.parameters())
    strategy.run(lambda: None)  # the chief's initial values (and FSDP2's sharding) before counting
    counted = _Collectives(strategy)

    def step(xb: torch.Tensor, yb: torch.Tensor, update: bool) -> None:
        per_example = ((model(xb) - yb) ** 2).mean(dim=1)
        loss = phalanx.compute_average_loss(per_example, global_batch_size=micro) / k
        loss.backward()
        if update:
            opt.step()
            opt.zero_grad()

    batches = [(x[i : i + micro], y[i : i + micro]) for i in range(0, len(x), micro)]
    for i, (xb, yb) in enumerate(strategy.experimental_distribute_dataset(batches)):
        update = (i + 1) % k == 0
        quiet = use_no_sync and not update
        with strategy.no_sync() if quiet else contextlib.nullcontext():
            strategy.run(step, args=(xb, yb, update))
    return {
        "state": {key: v.detach().clone() for key, v in model.state_dict().items()},
        "calls": counted.calls,
        "bytes": counted.bytes,
    }


def fit(strategy: phalanx.Strategy, batch_size: int, k: int | None) -> dict:
    """(every worker) ``fit`` over the same examples with ``gradient_accumulation_steps=k``."""
    x, y = _arrays()
    with strategy.scope():
        model = phalanx.Model(_net())
        model.compile(optimizer=_optimizer(model.parameters()), loss="mse", gradient_accumulation_steps=k)
    batches: list[int] = []
    seen = phalanx.callbacks.LambdaCallback(on_train_batch_end=lambda step, logs: batches.append(step))
    history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[seen])
    return {
        "state": {key: v.detach().clone() for key, v in model.module.state_dict().items()},
        "loss": history.history["loss"],
        "batches": batches,
    }


def _assert_weights(results: list[dict], want: dict[str, torch.Tensor]) -> None:
    for result in results:
        assert result["state"].keys() == want.keys()
        for key, value in want.items():
            np.testing.assert_allclose(result["state"][key].numpy(), value.numpy(), **TOL, err_msg=key)


@pytest.mark.parametrize("runner", RUNNERS, indirect=True)
def test_four_accumulated_batches_of_64_end_at_the_weights_of_one_batch_of_256(runner):
    _assert_weights(runner.run(custom_loop, MICRO, K), reference())


@pytest.mark.parametrize("runner", RUNNERS, indirect=True)
def test_fit_with_gradient_accumulation_steps_ends_at_the_weights_of_the_larger_batch(runner):
    results = runner.run(fit, MICRO, K)
    _assert_weights(results, reference())
    for result in results:  # callbacks and logs still count steps, as in Keras 3
        assert result["batches"] == list(range(K * UPDATES))


def test_the_reference_moves_when_the_batches_are_not_accumulated():
    # guards the tests above: four updates of batch 64 end elsewhere
    (result,) = [custom_loop(phalanx.OneDeviceStrategy("cpu"), MICRO, 1)]
    want = reference()
    assert not np.allclose(result["state"]["0.weight"].numpy(), want["0.weight"].numpy(), **TOL)


@_MP
@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]], ids=["buckets", "2replicas"])
def test_accumulating_moves_at_most_0_4x_the_bytes_of_synchronising_every_batch(mwms_2workers, devices):
    # one local replica: the gradient buckets; two: the replicas' packed sums across workers
    quiet = mwms_2workers.run(custom_loop, MICRO, K, strategy_kwargs={"devices": devices})
    loud = mwms_2workers.run(custom_loop, MICRO, K, False, strategy_kwargs={"devices": devices})
    _assert_weights(quiet, reference())
    _assert_weights(loud, reference())  # the same numbers: summing every pass sums the same deltas
    for q, w in zip(quiet, loud, strict=True):
        assert w["bytes"] > 0
        assert q["bytes"] <= 0.4 * w["bytes"], (q, w)  # measured: 0.25 (one all-reduce in four)


@_MP
def test_fully_sharded_accumulate_only_passes_skip_their_reduce_scatters(fsdp_2workers):
    # FSDP2 still all-gathers the parameters for every forward pass: only the gradients' traffic goes
    quiet = fsdp_2workers.run(custom_loop, MICRO, K)
    loud = fsdp_2workers.run(custom_loop, MICRO, K, False)
    for q, w in zip(quiet, loud, strict=True):
        assert q["calls"] < w["calls"], (q, w)
        assert q["bytes"] < w["bytes"], (q, w)


def early_and_late(strategy: phalanx.Strategy) -> list[torch.Tensor]:
    """(every worker) One head used by an accumulate-only pass only, the other by the next
    pass: each replica's gradient of the first head after the synchronised pass."""
    x = torch.arange(8.0 * strategy.num_replicas_in_sync).reshape(-1, 2) / 10
    with strategy.scope():
        torch.manual_seed(0)
        early, late = nn.Linear(2, 1), nn.Linear(2, 1)

    def step(xb: torch.Tensor, use_early: bool) -> torch.Tensor:
        (early if use_early else late)(xb).pow(2).sum().backward()
        return early.weight.grad.clone()

    batches = list(strategy.experimental_distribute_dataset([(x,), (x,)]))
    with strategy.no_sync():
        strategy.run(step, args=(*batches[0], True))
    return list(strategy.experimental_local_results(strategy.run(step, args=(*batches[1], False))))


@pytest.mark.parametrize("runner", ["mirrored_2cpu", pytest.param("mwms_2workers", marks=_MP)], indirect=True)
def test_a_parameter_reached_only_before_the_synchronised_pass_is_summed_by_it(runner):
    # under MultiWorkerMirrored its bucket gets the pending sum at the end of the pass
    torch.manual_seed(0)
    early = nn.Linear(2, 1)
    results = runner.run(early_and_late)
    n = len(results) * len(results[0])  # replicas in sync
    x = torch.arange(8.0 * n).reshape(-1, 2) / 10
    early(x).pow(2).sum().backward()
    for grads in results:
        for grad in grads:
            torch.testing.assert_close(grad, early.weight.grad)


def ps_accumulate(strategy: phalanx.Strategy) -> dict:
    """(chief) Each update is one scheduled function: K micro-batches on one worker, the first
    K - 1 inside ``no_sync()``, one ``optimizer.step()``; returns the pushes each made."""
    from phalanx.coordinator import ClusterCoordinator

    coordinator = ClusterCoordinator(strategy)
    x, y = _arrays()
    with strategy.scope():
        model = _net()
        opt = _optimizer(model.parameters())
    big = MICRO * K

    def update(u: int) -> int:
        env = strategy._env  # (on the worker) its connection to the ps tasks
        apply, pushes = env.ps.apply_gradients, []

        def counted(*args, **kwargs):
            pushes.append(1)
            return apply(*args, **kwargs)

        def micro(xb: torch.Tensor, yb: torch.Tensor, last: bool) -> None:
            (((model(xb) - yb) ** 2).mean(dim=1).sum() / big).backward()
            if last:
                opt.step()
                opt.zero_grad()

        env.ps.apply_gradients = counted
        try:
            for i in range(K):
                rows = slice(u * big + i * MICRO, u * big + (i + 1) * MICRO)
                with strategy.no_sync() if i < K - 1 else contextlib.nullcontext():
                    strategy.run(micro, args=(x[rows], y[rows], i == K - 1))
        finally:
            env.ps.apply_gradients = apply
        return len(pushes)

    pushes = [coordinator.schedule(update, args=(u,)).fetch() for u in range(UPDATES)]  # in order
    coordinator.join()
    return {"state": {key: v.detach().clone() for key, v in model.state_dict().items()}, "pushes": pushes}


@_MP
def test_a_parameter_server_worker_accumulates_and_pushes_once(ps_2workers_1ps):
    (result,) = ps_2workers_1ps.run(ps_accumulate)
    assert result["pushes"] == [1] * UPDATES
    _assert_weights([result], reference())
