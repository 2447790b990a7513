"""Replicas of one process whose all-reduces differ in shape or dtype fail on every replica
before anything is summed (`phalanx.strategies._rendezvous`): torch would broadcast a scalar
into a vector's sum without a word."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.errors import CollectiveMismatchError


@pytest.mark.parametrize("strategy_class", [phalanx.MirroredStrategy, phalanx.CentralStorageStrategy])
def test_an_all_reduce_of_another_shape_on_one_replica_is_named_on_every_replica(strategy_class):
    strategy = strategy_class(["cpu:0", "cpu:1"])

    def step():
        replica = phalanx.get_replica_context().replica_id_in_sync_group
        value = torch.ones(()) if replica == 1 else torch.ones(3)  # a rank-conditional log line
        return phalanx.get_replica_context().all_reduce("SUM", value)

    with pytest.raises(CollectiveMismatchError) as raised:
        strategy.run(step)
    message = str(raised.value)
    assert "arrived with other dtypes or shapes" in message
    assert "[float32[3]]" in message
    assert "[float32[]]" in message
    assert "test_replica_signatures.py" in message  # the call sites
    # matching calls still work afterwards
    result = strategy.run(lambda: phalanx.get_replica_context().all_reduce("SUM", torch.ones(2)))
    assert torch.equal(strategy.experimental_local_results(result)[0], torch.full((2,), 2.0))
