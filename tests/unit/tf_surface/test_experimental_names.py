"""phalanx.experimental's additions from TF 2.21 (CollectiveHints, submodules, ValueContext)."""

from __future__ import annotations

import warnings

import pytest

import phalanx
from phalanx import experimental


def test_collective_hints_warns_and_is_communication_options():
    with pytest.warns(DeprecationWarning, match="use phalanx.experimental.CommunicationOptions"):
        hints = experimental.CollectiveHints(bytes_per_pack=1024, timeout_seconds=5.0)
    assert hints == phalanx.CommunicationOptions(bytes_per_pack=1024, timeout_seconds=5.0)


def test_submodules_are_tf_experimental_spellings():
    assert experimental.coordinator is phalanx.coordinator
    assert experimental.coordinator.PerWorkerValues is phalanx.coordinator.PerWorkerValues
    assert experimental.partitioners is phalanx.partitioners
    assert experimental.rpc.Client.create is phalanx.rpc.Client.create
    assert experimental.ValueContext(1, 4).num_replicas_in_sync == 4


def test_star_import_still_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namespace: dict = {}
        exec("from phalanx.experimental import *", namespace)
    assert "PreemptionCheckpointHandler" in namespace
    assert "CollectiveHints" not in namespace
