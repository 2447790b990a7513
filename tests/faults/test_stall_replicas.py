"""In-process replicas (Mirrored, CentralStorage) that take different paths are named at once.

A replica that returns from its function while the others wait at a meeting point, or arrives
at another one, can never be met: every replica raises `CollectiveMismatchError` naming each
one's meeting point and call site; one that is elsewhere is named after the stall bound.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
from torch import nn

import phalanx
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError
from support.cluster import run_python


def _replica() -> int:
    return phalanx.get_replica_context().replica_id_in_sync_group


@pytest.fixture(params=["mirrored_2cpu", "central_storage_2cpu"])
def strategy(request, monkeypatch):
    monkeypatch.setenv("PHALANX_STALL_TIMEOUT_SECONDS", "3")  # read when the strategy is made
    return request.getfixturevalue(request.param)


def test_a_replica_that_skips_optimizer_step_is_named(strategy):
    with strategy.scope():
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model(x).sum().backward()
        if _replica() == 1:  # as GradScaler after an overflow seen by this replica only
            return
        optimizer.step()  # the line the message names

    with pytest.raises(CollectiveMismatchError) as caught:
        strategy.run(step, args=(torch.ones(4, 4),))
    message = str(caught.value)
    # Both replicas met at the end of backward (the gradient sum); the step is the next meeting.
    meeting = int(re.search(r"did not join meeting #(\d+): it returned from the function", message)[1])
    assert "but replicas [1] did not join" in message
    waiting = f"replica 0 waits in optimizer.step() #{meeting} (optimizer.step at test_stall_replicas.py:"
    assert waiting in message
    assert f"replica 1 returned from its function (it reached meetings up to #{meeting - 1})" in message
    assert "HINT: every replica must make the same calls in the same order" in message
    strategy.run(lambda: None)  # the strategy is usable again


def test_a_replica_conditional_all_reduce_is_named(strategy):
    def step():
        context = phalanx.get_replica_context()
        context.all_reduce("SUM", torch.ones(2))
        if _replica() == 0:
            context.all_reduce("SUM", torch.ones(3))  # "logging" on replica 0 only
        return context.replica_id_in_sync_group

    with pytest.raises(CollectiveMismatchError) as caught:
        strategy.run(step)
    message = str(caught.value)
    assert "replica 0 waits in all_reduce #2 (ReplicaContext.all_reduce at test_stall_replicas.py:" in message
    assert "replica 1 returned from its function (it reached meetings up to #1)" in message


def test_replicas_at_different_meeting_points_are_named(strategy):
    def step():
        context = phalanx.get_replica_context()
        if _replica() == 0:
            return context.all_reduce("SUM", torch.ones(2))
        return context.merge_call(lambda s: 0)

    with pytest.raises(CollectiveMismatchError) as caught:
        strategy.run(step)
    message = str(caught.value)
    assert "it arrived at another meeting point" in message
    assert "replica 0 waits in all_reduce #1 (ReplicaContext.all_reduce at test_stall_replicas.py:" in message
    assert "replica 1 waits in merge_call #1 (ReplicaContext.merge_call at test_stall_replicas.py:" in message


def test_a_replica_elsewhere_is_named_after_the_stall_bound(strategy):
    release = threading.Event()

    def step():
        if _replica() == 1:
            release.wait(30)  # blocked outside any meeting point, until replica 0 is told
            return None
        try:
            return phalanx.get_replica_context().all_reduce("SUM", torch.ones(2))
        finally:  # after the stall bound: replica 1 may go (strategy.run waits for both)
            release.set()

    try:
        with pytest.raises(CollectiveMismatchError) as caught:
            strategy.run(step)
    finally:
        release.set()
    message = str(caught.value)
    assert "it has not arrived after 3s (PHALANX_STALL_TIMEOUT_SECONDS)" in message
    assert "replica 1 is elsewhere (test_stall_replicas.py:" in message


def test_the_program_exits_non_zero():
    program = """
import torch, phalanx
strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
def step():
    if phalanx.get_replica_context().replica_id_in_sync_group == 0:
        phalanx.get_replica_context().all_reduce("SUM", torch.ones(1))
strategy.run(step)
print("not reached")
"""
    result = run_python("-c", program, timeout=60)
    assert result.returncode != 0
    assert "CollectiveMismatchError: Every replica must reach the same meeting points" in result.stderr
    assert "not reached" not in result.stdout


def test_the_inspector_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PHALANX_STALL_INSPECTOR", "0")
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=1)

    def step():
        if _replica() == 0:
            phalanx.get_replica_context().all_reduce("SUM", torch.ones(1))

    with pytest.raises(TimeoutError, match="waited 1s at all_reduce for replicas \\[1\\]"):
        strategy.run(step)


def test_a_bad_stall_bound_is_refused_when_replicas_are_made(monkeypatch):
    monkeypatch.setenv("PHALANX_STALL_TIMEOUT_SECONDS", "soon")
    assert phalanx.get_strategy().run(lambda: 1) == 1  # one replica meets nobody: unaffected
    with pytest.raises(ValueError, match="PHALANX_STALL_TIMEOUT_SECONDS must be a positive number"):
        phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
