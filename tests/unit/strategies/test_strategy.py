"""The Strategy API on every in-process strategy: run, regrouping, reduce, gather, values, update."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn

import phalanx
from phalanx.strategies.strategy import ValueContext

Pair = namedtuple("Pair", "a b")


def _per_replica(strategy, values):
    """A distributed value whose component on replica r is values[r]."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group]
    )


def _rid():
    return phalanx.get_replica_context().replica_id_in_sync_group


def test_values_from_function_and_value_context(any_strategy):
    seen = []

    def value_fn(ctx):
        seen.append(ctx)
        return torch.tensor(float(ctx.replica_id_in_sync_group))

    value = any_strategy.experimental_distribute_values_from_function(value_fn)
    n = any_strategy.num_replicas_in_sync
    assert [(c.replica_id_in_sync_group, c.num_replicas_in_sync) for c in seen] == [(i, n) for i in range(n)]
    assert [t.item() for t in any_strategy.experimental_local_results(value)] == list(range(n))
    assert isinstance(value, phalanx.PerReplica) == (n > 1)
    assert repr(ValueContext(1, 2)) == "ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)"


def test_run_passes_each_replica_its_components_of_nested_args_and_kwargs(any_strategy):
    n = any_strategy.num_replicas_in_sync
    per = _per_replica(any_strategy, [torch.tensor(float(10 * r)) for r in range(n)])
    shared = torch.ones(1)
    args = ({"x": per, "pair": Pair(per, 5)}, [per, shared])
    kwargs = {"scale": _per_replica(any_strategy, list(range(1, n + 1))), "label": "same"}

    def fn(nest, items, scale, label):
        assert isinstance(nest["pair"], Pair)
        assert nest["pair"].b == 5
        assert items[1] is shared  # plain values reach every replica unchanged
        assert label == "same"
        return nest["x"] * scale + items[0]

    out = any_strategy.run(fn, args=args, kwargs=kwargs)
    assert [t.item() for t in any_strategy.experimental_local_results(out)] == [
        10.0 * r * (r + 1) + 10.0 * r for r in range(n)
    ]
    assert any_strategy.run(lambda *a: len(a), args=[1, 2, 3]) == 3  # args may be a list


def test_run_regroups_results_by_structure(any_strategy):
    n = any_strategy.num_replicas_in_sync
    shared = torch.zeros(2)

    def fn():
        r = _rid()
        return {"id": torch.tensor(r), "same": shared, "pair": Pair(torch.tensor([r]), "tag"), "list": [r, 7]}

    out = any_strategy.run(fn)
    assert isinstance(out, dict)
    assert out["same"] is shared  # the same object on every replica stays plain
    assert out["pair"].b == "tag"
    assert isinstance(out["pair"], Pair)
    assert out["list"][1] == 7
    ids = any_strategy.experimental_local_results(out["id"])
    assert [t.item() for t in ids] == list(range(n))
    assert isinstance(out["id"], phalanx.PerReplica) == (n > 1)
    assert any_strategy.experimental_local_results(out["list"][0]) == tuple(range(n))
    assert any_strategy.experimental_local_results(3) == (3,)


def test_reduce_across_replicas_with_axis_none(any_strategy):
    n = any_strategy.num_replicas_in_sync
    value = _per_replica(any_strategy, [torch.tensor([1.0, 2.0]) * (r + 1) for r in range(n)])
    total = sum(r + 1 for r in range(n))
    torch.testing.assert_close(any_strategy.reduce("sum", value, axis=None), torch.tensor([1.0, 2.0]) * total)
    torch.testing.assert_close(
        any_strategy.reduce(phalanx.ReduceOp.MEAN, value, axis=None), torch.tensor([1.0, 2.0]) * total / n
    )
    nested = any_strategy.reduce("SUM", {"a": value, "b": [value, Pair(value, value)]}, axis=None)
    torch.testing.assert_close(nested["b"][1].a, nested["a"])
    assert isinstance(nested["b"][1], Pair)


@pytest.mark.parametrize(
    "sizes",
    [[3, 5], [13, 12], [1, 0], [0, 0, 0, 2]],
    ids=["uneven", "25_over_2", "empty_replica", "mostly_empty"],
)
def test_reduce_and_gather_along_an_axis_use_the_true_element_count(sizes):
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(len(sizes))])
    try:
        parts = [torch.arange(float(s)).reshape(s, 1).repeat(1, 2) + 100 * r for r, s in enumerate(sizes)]
        value = _per_replica(strategy, parts)
        everything = torch.cat(parts)
        # "MEAN uses the true element count": not the mean of the replicas' means
        torch.testing.assert_close(strategy.reduce("mean", value, axis=0), everything.mean(0))
        torch.testing.assert_close(strategy.reduce("sum", value, axis=0), everything.sum(0))
        torch.testing.assert_close(strategy.gather(value, axis=0), everything)
        torch.testing.assert_close(strategy.gather({"v": [value]}, axis=0)["v"][0], everything)
    finally:
        strategy._threads.close()


def test_gather_along_axis_1_and_of_scalars(mirrored_2cpu):
    value = _per_replica(mirrored_2cpu, [torch.ones(2, 1), torch.zeros(2, 3)])
    torch.testing.assert_close(
        mirrored_2cpu.gather(value, axis=1), torch.cat([torch.ones(2, 1), torch.zeros(2, 3)], 1)
    )
    scalars = _per_replica(mirrored_2cpu, [torch.tensor(1.0), torch.tensor(2.0)])
    torch.testing.assert_close(mirrored_2cpu.gather(scalars, axis=0), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(mirrored_2cpu.reduce("mean", scalars, axis=None), torch.tensor(1.5))


def test_reduce_of_run_results(any_strategy):
    def fn():
        return torch.tensor([1.0, 2.0, 3.0])[: _rid() + 2]  # replicas return 2, 3, ... examples

    out = any_strategy.run(fn)
    n = any_strategy.num_replicas_in_sync
    everything = torch.cat([torch.tensor([1.0, 2.0, 3.0])[: r + 2] for r in range(n)])
    assert any_strategy.reduce("mean", out, axis=0).item() == pytest.approx(everything.mean().item())
    assert any_strategy.reduce("sum", out, axis=0).item() == pytest.approx(everything.sum().item())


@pytest.mark.parametrize("name", ["mirrored_2cpu", "central_storage_2cpu"])
def test_mean_of_a_value_identical_on_every_replica_is_that_value(name, request):
    strategy = request.getfixturevalue(name)
    value = torch.tensor([4.0, 6.0])
    out = strategy.run(lambda: value)  # every replica returns the same object: regrouped to plain
    assert out is value
    torch.testing.assert_close(strategy.reduce("mean", out, axis=None), value)
    torch.testing.assert_close(strategy.reduce("mean", {"v": 4.0}, axis=None)["v"], torch.tensor(4.0))


def test_local_results_of_a_variable_are_its_components(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 2)
    mirrored_2cpu.run(lambda: None)
    results = mirrored_2cpu.experimental_local_results(layer.weight)
    assert len(results) == 2
    assert all(type(c) is torch.Tensor for c in results)


def test_run_rejects_a_per_replica_of_the_wrong_length(mirrored_2cpu):
    with pytest.raises(ValueError, match="3"):
        mirrored_2cpu.run(lambda x: x, args=(phalanx.PerReplica([torch.ones(1)] * 3),))


def test_reduce_to_and_batch_reduce_to(any_strategy):
    n = any_strategy.num_replicas_in_sync
    value = _per_replica(any_strategy, [torch.ones(2) * (r + 1) for r in range(n)])
    total = float(sum(range(1, n + 1)))
    torch.testing.assert_close(any_strategy.reduce_to("sum", value, "cpu"), torch.full((2,), total))
    to_two = any_strategy.extended.reduce_to(phalanx.ReduceOp.MEAN, value, ["cpu", "cpu"])
    assert isinstance(to_two, phalanx.Mirrored)
    assert len(to_two) == 2
    torch.testing.assert_close(to_two.values[1], torch.full((2,), total / n))
    out = any_strategy.batch_reduce_to("mean", [(value, "cpu"), (value, torch.zeros(1))])
    assert len(out) == 2
    torch.testing.assert_close(out[1], torch.full((2,), total / n))
    assert any_strategy.batch_reduce_to("sum", []) == []


def test_cross_device_ops_reduce_and_batch_reduce(mirrored_2cpu):
    ops = phalanx.ReductionToOneDevice()
    value = _per_replica(mirrored_2cpu, [torch.ones(2), torch.ones(2) * 3])
    ints = _per_replica(mirrored_2cpu, [torch.ones(1, dtype=torch.int64)] * 2)
    torch.testing.assert_close(ops.reduce("mean", value, "cpu"), torch.full((2,), 2.0))
    packed = ops.batch_reduce("sum", [(value, "cpu"), (ints, "cpu")])  # mixed dtypes, packed per dtype
    torch.testing.assert_close(packed[0], torch.full((2,), 4.0))
    assert packed[1].item() == 2
    assert packed[1].dtype == torch.int64
    with pytest.raises(ValueError, match="same number of components"):
        ops.batch_reduce("sum", [(value, "cpu"), (torch.ones(2), "cpu")])
    custom = phalanx.ReductionToOneDevice("cpu", accumulation_fn=lambda ts: torch.stack(ts).max(0).values)
    torch.testing.assert_close(custom.reduce("sum", value, "cpu"), torch.full((2,), 3.0))


def test_update_applies_fn_to_every_component(any_strategy):
    with any_strategy.scope():
        layer = nn.Linear(2, 2)
    any_strategy.run(lambda: None)
    n = any_strategy.num_replicas_in_sync
    increments = _per_replica(any_strategy, [torch.full((2,), 1.0)] * n)
    results = any_strategy.extended.update(
        layer.bias, lambda c, inc: c.fill_(0).add_(inc), args=(increments,)
    )
    assert len(any_strategy.experimental_local_results(results)) >= 1
    out = any_strategy.run(lambda: layer.bias.clone())
    for value in any_strategy.experimental_local_results(out):
        torch.testing.assert_close(value, torch.ones(2))
    plain = torch.zeros(2)
    any_strategy.update(plain, lambda c, v: c.add_(v), args=(2.0,))  # a plain tensor: fn applied once
    torch.testing.assert_close(plain, torch.full((2,), 2.0))
    if isinstance(layer.bias, phalanx.MirroredVariable):
        ungrouped = any_strategy.update(layer.bias, lambda c: c.sum(), group=False)
        assert isinstance(ungrouped, tuple)
        assert len(ungrouped) == len(layer.bias.components)


def test_strategy_identity(any_strategy):
    assert any_strategy.extended is any_strategy
    assert any_strategy.is_chief
    assert any_strategy.should_checkpoint
    assert any_strategy.should_save_summary
    assert any_strategy.cluster_resolver is None
    assert len(any_strategy.worker_devices) == any_strategy.num_replicas_in_sync
    assert type(any_strategy).__name__.replace("Strategy", "") in repr(any_strategy)


def test_a_steps_global_batch_size_does_not_outlive_the_step(any_strategy):
    batches = iter(any_strategy.experimental_distribute_dataset([torch.zeros(16, 1)]))
    any_strategy.run(lambda x: None, args=(next(batches),))
    # outside any scope and run: the default strategy's replica context, local batch rule
    assert phalanx.compute_average_loss(torch.tensor([1.0, 2.0, 3.0])).item() == 2.0


def test_run_reads_the_environment_at_its_first_call_only(any_strategy, monkeypatch):
    # `phalanx.settings.current()` reads every PHALANX_* variable: once a step cost more than
    # the rest of run's bookkeeping (the opt-in timeline is decided at a scope or the first run)
    from phalanx import settings

    reads = []
    real = settings.current
    monkeypatch.setattr(settings, "current", lambda: reads.append(1) or real())
    for _ in range(3):
        any_strategy.run(lambda x: x * 2, args=(torch.tensor(1.0),))
    assert len(reads) <= 1  # none for the default strategy, which never traces
