"""Contexts: default strategy, scopes, replica and cross-replica context, threads, mixing strategies."""

from __future__ import annotations

import threading

import pytest
import torch

import phalanx
from phalanx.strategies import DefaultStrategy


def _context_snapshot():
    ctx = phalanx.get_replica_context()
    return (
        phalanx.get_strategy(),
        phalanx.has_strategy(),
        phalanx.in_cross_replica_context(),
        None if ctx is None else ctx.replica_id_in_sync_group,
    )


def test_default_strategy_outside_any_scope():
    strategy = phalanx.get_strategy()
    assert isinstance(strategy, DefaultStrategy)
    assert strategy is phalanx.get_strategy()  # a singleton
    assert not phalanx.has_strategy()
    assert not phalanx.in_cross_replica_context()
    ctx = phalanx.get_replica_context()
    assert ctx.strategy is strategy
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (0, 1)
    assert strategy.run(lambda a, b=1: a + b, args=(1,), kwargs={"b": 2}) == 3
    assert strategy.reduce("sum", torch.tensor(3.0)).item() == 3.0
    assert ctx.all_reduce("sum", torch.tensor(2.0)).item() == 2.0
    assert ctx.merge_call(lambda s, x: x * 2, args=(3,)) == 6
    assert strategy.extended is strategy
    assert strategy.should_checkpoint
    assert strategy.cluster_resolver is None
    with strategy.scope():  # the default scope changes nothing
        assert not phalanx.has_strategy()
        assert phalanx.get_replica_context() is ctx


@pytest.mark.parametrize("name", ["one_device", "mirrored_2cpu", "central_storage_2cpu"])
def test_contexts_in_scope_in_run_and_in_merge_call(name, request):
    strategy = request.getfixturevalue(name)
    assert _context_snapshot()[1:] == (False, False, 0)
    with strategy.scope() as entered:
        assert entered is strategy
        assert _context_snapshot() == (strategy, True, True, None)
        with strategy.scope():  # nesting the same scope is fine
            assert _context_snapshot() == (strategy, True, True, None)
        assert _context_snapshot() == (strategy, True, True, None)

    seen = {}

    def fn():
        in_replica = _context_snapshot()
        with strategy.scope():  # re-entering the scope inside run keeps the replica context
            in_scope = _context_snapshot()
        ctx = phalanx.get_replica_context()
        in_merge = ctx.merge_call(lambda s: _context_snapshot())
        seen[ctx.replica_id_in_sync_group] = (in_replica, in_scope, in_merge, threading.current_thread())

    strategy.run(fn)
    assert sorted(seen) == list(range(strategy.num_replicas_in_sync))
    for index, (in_replica, in_scope, in_merge, _) in seen.items():
        assert in_replica == (strategy, True, False, index)
        assert in_scope == in_replica
        assert in_merge == (strategy, True, True, None)
    assert len({thread for *_, thread in seen.values()}) == len(seen)  # one thread per replica
    assert _context_snapshot()[1:] == (False, False, 0)  # everything was popped


def test_threads_see_their_own_context(mirrored_2cpu, one_device):
    entered, release = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        seen["before"] = _context_snapshot()[1:]
        with one_device.scope():
            seen["inside"] = phalanx.get_strategy()
            entered.set()
            release.wait(5)

    with mirrored_2cpu.scope():
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert entered.wait(5)
        # both scopes are open at once, each on its own thread
        assert phalanx.get_strategy() is mirrored_2cpu
        release.set()
        thread.join(5)
    assert seen == {"before": (False, False, 0), "inside": one_device}


def test_experimental_set_strategy_sets_replaces_and_unsets(one_device, mirrored_2cpu):
    phalanx.experimental_set_strategy(one_device)
    assert _context_snapshot() == (one_device, True, True, None)
    phalanx.experimental_set_strategy(mirrored_2cpu)  # replaces, no mixing error
    assert phalanx.get_strategy() is mirrored_2cpu
    out = mirrored_2cpu.run(lambda: phalanx.get_replica_context().replica_id_in_sync_group)
    assert mirrored_2cpu.experimental_local_results(out) == (0, 1)
    phalanx.experimental_set_strategy(None)
    assert not phalanx.has_strategy()
    phalanx.experimental_set_strategy(None)  # unsetting twice is harmless
    assert not phalanx.has_strategy()


def test_experimental_set_strategy_cannot_leave_a_scope_opened_on_top(one_device):
    phalanx.experimental_set_strategy(one_device)
    with one_device.scope(), pytest.raises(RuntimeError, match="another scope is open on top of it"):
        phalanx.experimental_set_strategy(None)
    phalanx.experimental_set_strategy(None)
    assert not phalanx.has_strategy()


def test_experimental_set_strategy_inside_a_scope_is_refused(one_device):
    with one_device.scope(), pytest.raises(RuntimeError, match="inside"):
        phalanx.experimental_set_strategy(one_device)
    assert not phalanx.has_strategy()  # leaving the scope left nothing behind


def test_experimental_set_strategy_to_another_strategy_inside_a_scope_is_refused(one_device, mirrored_2cpu):
    with one_device.scope(), pytest.raises(RuntimeError, match="inside"):
        phalanx.experimental_set_strategy(mirrored_2cpu)
    assert not phalanx.has_strategy()


def test_mixing_two_strategies_scopes_raises_a_helpful_error(one_device, mirrored_2cpu):
    with (
        one_device.scope(),
        pytest.raises(RuntimeError, match="Mixing different strategies") as info,
        mirrored_2cpu.scope(),
    ):
        pass
    message = str(info.value)
    assert "MirroredStrategy" in message
    assert "OneDeviceStrategy" in message
    assert "HINT" in message
    with one_device.scope(), pytest.raises(RuntimeError, match=r"\.run was called inside the scope of"):
        mirrored_2cpu.run(lambda: None)

    def enter_other_scope():
        with one_device.scope():
            pass

    with pytest.raises(RuntimeError, match="Mixing different strategies"):
        mirrored_2cpu.run(enter_other_scope)
    assert not phalanx.has_strategy()


def test_autocast_and_inference_mode_reach_every_replica(mirrored_2cpu):
    def modes():
        return (
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"),
            (torch.ones(2, 2) @ torch.ones(2, 2)).dtype,
        )

    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen = mirrored_2cpu.experimental_local_results(mirrored_2cpu.run(modes))
    assert all(s == (False, True, torch.bfloat16) for s in seen), seen
    with torch.inference_mode():
        seen = mirrored_2cpu.experimental_local_results(mirrored_2cpu.run(modes))
    assert all(s == (True, False, torch.float32) for s in seen), seen
