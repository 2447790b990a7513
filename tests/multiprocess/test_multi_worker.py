"""MultiWorkerMirroredStrategy with real processes on 127.0.0.1 over gloo."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx
from phalanx.cluster import launch
from support import oracle

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"
ENV = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _launch(script, args, workers=2, timeout=120):
    out = io.StringIO()
    code = launch(
        str(SCRIPTS / script), workers=workers, args=[str(a) for a in args], env=ENV, timeout=timeout, out=out
    )
    return code, out.getvalue()


def _results(tmp_path, workers):
    return [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(workers)], [
        torch.load(tmp_path / f"state-{r}.pt")["state"] for r in range(workers)
    ]


def test_two_workers_reproduce_ctl_mirrored(tmp_path):
    code, output = _launch("ctl_oracle.py", [tmp_path])
    assert code == 0, output
    assert "[worker-1] done 1 2" in output
    results, states = _results(tmp_path, 2)
    ref, meta = oracle.reference("ctl_mirrored")
    for r in range(2):
        np.testing.assert_allclose(results[r]["losses"], ref["losses"], **oracle.LOSS_TOL)
        for name, value in states[r].items():
            np.testing.assert_allclose(value.numpy(), ref[f"final/torch/{name}"], **oracle.WEIGHT_TOL)
    # worker 0 saw 0..15 and worker 1 16..31 at step 0, as two in-process replicas would
    assert [results[0]["seen"][0][0], results[1]["seen"][0][0]] == meta["replica_indices_per_step"][0]


def test_two_workers_with_two_local_replicas_equal_four_replicas(tmp_path):
    code, output = _launch("ctl_oracle.py", [tmp_path, 2, 250])
    assert code == 0, output
    results, states = _results(tmp_path, 2)
    assert results[0]["replicas"] == 4
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    losses, state, seen = oracle.run_ctl(strategy, n=250)
    strategy._threads.close()
    np.testing.assert_allclose(results[1]["losses"], losses, rtol=1e-6, atol=1e-6)
    assert results[0]["seen"]
    assert [s[0] for s in results[0]["seen"]] == [s[0] for s in seen]
    for name, value in state.items():
        np.testing.assert_allclose(states[1][name].numpy(), value.numpy(), rtol=1e-6, atol=1e-6)
