"""Replica execution: reduce/gather, collectives and their gradients, failures and timeouts."""

from __future__ import annotations

import time

import pytest
import torch

import phalanx
from phalanx.strategies._rendezvous import Rendezvous, ReplicaAbortedError, ReplicaTimeoutError


def _per_replica(strategy, values):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group]
    )


def test_reduce_and_gather_with_partial_batches(any_strategy):
    n = any_strategy.num_replicas_in_sync
    parts = [torch.arange(3.0), torch.arange(5.0) + 10][:n] if n == 2 else [torch.arange(3.0)]
    value = _per_replica(any_strategy, parts)
    everything = torch.cat(parts)
    assert any_strategy.reduce("mean", value, axis=0).item() == pytest.approx(everything.mean().item())
    assert any_strategy.reduce("sum", value, axis=0).item() == pytest.approx(everything.sum().item())
    torch.testing.assert_close(any_strategy.gather(value, axis=0), everything)
    scalars = _per_replica(any_strategy, [torch.tensor(2.0), torch.tensor(4.0)][:n])
    assert any_strategy.reduce(phalanx.ReduceOp.MEAN, scalars, axis=None).item() == pytest.approx(
        3.0 if n == 2 else 2.0
    )
    nested = any_strategy.reduce("sum", {"a": scalars, "b": [scalars]}, axis=None)
    assert nested["a"].item() == nested["b"][0].item()
    assert len(any_strategy.experimental_local_results(value)) == n


def test_reduce_to_batch_reduce_and_update(mirrored_2cpu):
    value = _per_replica(mirrored_2cpu, [torch.ones(2), torch.ones(2) * 3])
    torch.testing.assert_close(mirrored_2cpu.reduce_to("sum", value, "cpu"), torch.full((2,), 4.0))
    out = mirrored_2cpu.batch_reduce_to("mean", [(value, "cpu"), (value, "cpu")])
    torch.testing.assert_close(out[1], torch.full((2,), 2.0))
    packed = phalanx.ReductionToOneDevice().batch_reduce(
        "sum", [(value, "cpu"), (_per_replica(mirrored_2cpu, [torch.ones(1, dtype=torch.int64)] * 2), "cpu")]
    )
    assert packed[1].item() == 2
    with mirrored_2cpu.scope():
        layer = torch.nn.Linear(2, 2)
    mirrored_2cpu.run(lambda: None)
    mirrored_2cpu.update(layer.bias, lambda c: c.fill_(1.0))
    assert all(bool((c == 1).all()) for c in layer.bias.components)


def test_all_reduce_and_all_gather_are_differentiable(mirrored_2cpu):
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]

    def fn():
        ctx = phalanx.get_replica_context()
        x = xs[ctx.replica_id_in_sync_group].clone().requires_grad_()
        total = ctx.all_reduce("sum", x.sum() * (ctx.replica_id_in_sync_group + 1))
        mean = ctx.all_reduce("mean", {"v": x.sum()})["v"]
        gathered = ctx.all_gather(x * 2, axis=0)
        (total + mean + gathered.sum()).backward()
        return total.detach(), gathered.detach(), x.grad

    total, gathered, grads = (mirrored_2cpu.experimental_local_results(v) for v in mirrored_2cpu.run(fn))
    assert [t.item() for t in total] == [3.0 + 6.0] * 2
    torch.testing.assert_close(gathered[1], torch.tensor([2.0, 4.0, 6.0]))
    # Each replica's x.grad sums the gradients of every replica's loss (backward all-reduces):
    # total: 2 replicas x weight w_q; mean: 2 x 1/2; gathered: 2 replicas x 2.
    torch.testing.assert_close(grads[0], torch.full((2,), 2 * 1 + 1.0 + 4.0))
    torch.testing.assert_close(grads[1], torch.full((1,), 2 * 2 + 1.0 + 4.0))


def test_a_replica_that_raises_fails_run_promptly_and_strategy_stays_usable():
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=60)

    def fn():
        ctx = phalanx.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            raise KeyError("replica 1 broke")
        return ctx.all_reduce("sum", torch.ones(1))  # replica 0 waits here

    start = time.monotonic()
    with pytest.raises(KeyError, match="replica 1 broke"):
        strategy.run(fn)
    assert time.monotonic() - start < 5
    out = strategy.run(lambda: phalanx.get_replica_context().all_reduce("sum", torch.ones(1)))
    assert [t.item() for t in strategy.experimental_local_results(out)] == [2.0, 2.0]
    strategy._threads.close()


def test_a_skipped_collective_times_out_naming_the_missing_replica():
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=0.5)

    def fn():
        ctx = phalanx.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            ctx.all_reduce("sum", torch.ones(1))

    with pytest.raises(ReplicaTimeoutError, match=r"for replicas \[1\], which never arrived"):
        strategy.run(fn)
    strategy._threads.close()


def test_rendezvous_unit():
    r = Rendezvous(1, 1.0)
    assert r.exchange(0, 5) == [5]
    assert r.exchange(0, 5, lambda v: v[0] + 1) == 6
    two = Rendezvous(2, 0.2)
    two.abort(RuntimeError("x"))
    with pytest.raises(ReplicaAbortedError, match="another replica failed"):
        two.exchange(0, 1)
    two.reset()
    with pytest.raises(ReplicaTimeoutError, match=r"replicas \[1\]"):
        two.exchange(0, 1, what="a test")


def test_leader_errors_reach_every_replica(mirrored_2cpu):
    def fn():
        return phalanx.get_replica_context().merge_call(lambda s: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        mirrored_2cpu.run(fn)
