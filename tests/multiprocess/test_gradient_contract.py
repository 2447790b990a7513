"""DDP's gradient contract under MultiWorkerMirroredStrategy, on two worker processes.

Both layouts (one local replica: gradient buckets all-reduced during backward; two local
replicas: mirrored variables) and both transports (shared memory and gloo alone): once
``backward()`` returns inside ``run``, ``.grad`` holds the sum over every replica of every
worker, ``clip_grad_norm_`` and in-place edits before the step act on it, and the update is
the one-device update. The in-process strategies are checked by
tests/unit/strategies/test_gradient_contract.py, whose step this test reuses.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess

_UNIT = Path(__file__).parents[1] / "unit" / "strategies" / "test_gradient_contract.py"
CASES = [("none", 1), ("clip", 1), ("clip", 2), ("halve", 2), ("zero_first", 1)]


def _contract():
    """The unit test module (by file: the worker processes import this module by file too)."""
    spec = importlib.util.spec_from_file_location("gradient_contract_steps", _UNIT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def every_case(strategy):
    """Runs every (edit, passes) case on this worker; returns what each saw and the weights."""
    contract = _contract()
    out = {}
    for edit, passes in CASES:
        out[f"{edit}-{passes}"] = contract.train(strategy, edit, passes)
    out["buckets"] = strategy._buckets is not None
    return out


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]], ids=["1replica", "2replicas"])
@pytest.mark.parametrize("transport", ["shared_memory", "gloo"])
def test_grad_after_backward_is_the_sum_under_two_workers(mwms_2workers, devices, transport):
    env = {"PHALANX_SHARED_MEMORY": "1" if transport == "shared_memory" else "0"}
    results = mwms_2workers.run(every_case, strategy_kwargs={"devices": devices}, env=env)
    contract = _contract()
    assert len(results) == 2
    for result in results:
        assert result["buckets"] is (len(devices) == 1)
        for edit, passes in CASES:
            contract.check(result[f"{edit}-{passes}"], edit, passes)
    torch.testing.assert_close(results[0]["clip-1"][1], results[1]["clip-1"][1])
