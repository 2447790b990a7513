"""Contexts: default strategy, scopes, replica and cross-replica context, threads, misuse."""

from __future__ import annotations

import threading

import pytest
import torch

import phalanx


def test_default_strategy_outside_any_scope():
    strategy = phalanx.get_strategy()
    assert not phalanx.has_strategy()
    assert not phalanx.in_cross_replica_context()
    ctx = phalanx.get_replica_context()
    assert ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1
    assert strategy.run(lambda a, b=1: a + b, args=(1,), kwargs={"b": 2}) == 3
    assert strategy.reduce("sum", torch.tensor(3.0)).item() == 3.0
    assert ctx.all_reduce("sum", torch.tensor(2.0)).item() == 2.0
    assert ctx.merge_call(lambda s, x: x * 2, args=(3,)) == 6
    assert strategy.extended is strategy
    assert strategy.should_checkpoint
    assert strategy.cluster_resolver is None


def test_scope_run_and_merge_contexts(mirrored_2cpu):
    seen = {}
    with mirrored_2cpu.scope() as s:
        assert s is mirrored_2cpu
        assert phalanx.get_strategy() is mirrored_2cpu
        assert phalanx.has_strategy()
        assert phalanx.in_cross_replica_context()
        assert phalanx.get_replica_context() is None
        with mirrored_2cpu.scope():  # nesting the same scope is fine
            assert phalanx.in_cross_replica_context()

    def fn():
        ctx = phalanx.get_replica_context()
        seen[ctx.replica_id_in_sync_group] = (
            threading.current_thread().name,
            phalanx.in_cross_replica_context(),
        )
        return ctx.merge_call(
            lambda strategy, v: (phalanx.in_cross_replica_context(), strategy.experimental_local_results(v)),
            args=(ctx.replica_id_in_sync_group,),
        )

    result = mirrored_2cpu.run(fn)
    assert sorted(seen) == [0, 1]
    assert seen[0][1] is False
    assert seen[0][0] != seen[1][0]  # replicas run on different threads
    assert mirrored_2cpu.experimental_local_results(result)[0] == (True, (0, 1))
    assert not phalanx.has_strategy()


def test_threads_see_their_own_context(mirrored_2cpu):
    results = []
    with mirrored_2cpu.scope():
        thread = threading.Thread(target=lambda: results.append(phalanx.has_strategy()))
        thread.start()
        thread.join()
    assert results == [False]


def test_experimental_set_strategy(one_device):
    phalanx.experimental_set_strategy(one_device)
    assert phalanx.get_strategy() is one_device
    phalanx.experimental_set_strategy(None)
    assert not phalanx.has_strategy()
    phalanx.experimental_set_strategy(one_device)
    with one_device.scope(), pytest.raises(RuntimeError, match="another scope is open"):
        phalanx.experimental_set_strategy(None)
    phalanx.experimental_set_strategy(None)


def test_mixing_scopes_and_misuse(one_device, mirrored_2cpu):
    with one_device.scope(), pytest.raises(RuntimeError, match="Mixing different strategies"):
        mirrored_2cpu.scope().__enter__()
    with one_device.scope(), pytest.raises(RuntimeError, match="inside the scope of"):
        mirrored_2cpu.run(lambda: None)
    with pytest.raises(RuntimeError, match="must be called in cross-replica context"):
        mirrored_2cpu.run(lambda: mirrored_2cpu.reduce("sum", torch.ones(1)))
    with pytest.raises(RuntimeError, match="gather must be called in cross-replica"):
        mirrored_2cpu.run(lambda: mirrored_2cpu.gather(torch.ones(1), axis=0))
    with pytest.raises(RuntimeError, match="inside another run"):
        mirrored_2cpu.run(lambda: mirrored_2cpu.run(lambda: None))
    with pytest.raises(TypeError, match="takes args as a tuple or list"):
        mirrored_2cpu.run(lambda x: x, args=torch.ones(1))
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        mirrored_2cpu.run(lambda: None, kwargs=[1])
    with pytest.raises(TypeError, match="needs a callable"):
        mirrored_2cpu.run(3)
    with pytest.raises(ValueError, match="reduce op must be"):
        mirrored_2cpu.reduce("max", torch.ones(1))
    with pytest.raises(TypeError, match="merge_call args must be a tuple"):
        phalanx.get_replica_context().merge_call(lambda s: None, args=3)


def test_device_and_cross_device_op_errors():
    with pytest.raises(ValueError, match="Unknown device"):
        phalanx.MirroredStrategy(["tpu:0"])
    with pytest.raises(ValueError, match="Devices must be distinct"):
        phalanx.MirroredStrategy(["cpu:0", "/cpu:0"])
    with pytest.raises(ValueError, match="at least one device"):
        phalanx.MirroredStrategy([])
    assert phalanx.MirroredStrategy(["/gpu:0"]).worker_devices == ("cuda:0",)
    for ops in (phalanx.NcclAllReduce(), phalanx.HierarchicalCopyAllReduce()):
        with pytest.raises(ValueError, match="works across CUDA devices only"):
            ops.reduce("sum", phalanx.PerReplica([torch.ones(1), torch.ones(1)]), "cpu")
    with pytest.raises(ValueError, match="num_packs must be >= 1"):
        phalanx.NcclAllReduce(num_packs=0)
    with pytest.raises(ValueError, match="at least one component"):
        phalanx.PerReplica([])
