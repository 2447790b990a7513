"""phalanx.input exports the distributed-input names (frozen here)."""

from __future__ import annotations

import phalanx.input

EXPECTED = [
    "AutoShardPolicy",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "Optional",
    "OutOfRangeError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
]


def test_public_names_are_frozen():
    assert sorted(phalanx.input.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(phalanx.input, name).__module__.startswith("phalanx.input.")


def test_the_coordinator_exports_the_same_per_worker_classes():
    assert phalanx.coordinator.PerWorkerValues is phalanx.input.PerWorkerValues
    assert phalanx.coordinator.OutOfRangeError is phalanx.input.OutOfRangeError
