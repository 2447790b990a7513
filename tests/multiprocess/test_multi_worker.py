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


def test_uneven_workers_end_the_epoch_together(tmp_path):
    code, output = _launch("uneven_epoch.py", [tmp_path])
    assert code == 0, output
    results = [json.loads((tmp_path / f"steps-{r}.json").read_text()) for r in range(2)]
    assert results[0]["sizes"] == [4, 4, 0, 0] * 2  # worker 0 ran out: empty batches, same steps
    assert results[1]["sizes"] == [4, 4, 4, 4] * 2
    assert results[0]["weight"] == results[1]["weight"]


def test_keras_under_two_workers_restore_metrics_and_predict_order(tmp_path):
    from phalanx.checkpoint import Checkpoint

    torch.manual_seed(3)
    with phalanx.OneDeviceStrategy("cpu").scope():
        net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    path = Checkpoint(model=net).write(str(tmp_path / "one_device.pt"))
    code, output = _launch("keras_checks.py", [path, tmp_path])
    assert code == 0, output
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(53, 4, generator=g), torch.randint(0, 3, (53,), generator=g)
    with torch.no_grad():
        expected = net(x)
    reference = phalanx.metrics.SparseCategoricalAccuracy()
    reference.update_state(y[:25], expected[:25])
    loss = phalanx.losses.SparseCategoricalCrossentropy(from_logits=True)(y, expected).item()
    for rank in range(2):
        result = json.loads((tmp_path / f"keras-{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(result["weight"]), net[0].weight.detach())
        torch.testing.assert_close(torch.tensor(result["predictions"]), expected)  # input order, 53 = 6x8 + 5
        assert result["metric"] == pytest.approx(reference.result().item())
        assert result["loss"] == pytest.approx(loss, rel=1e-5)


def test_sync_batch_norm_across_workers(tmp_path):
    code, output = _launch("sync_bn.py", [tmp_path])
    assert code == 0, output
    x = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3) ** 1.5
    reference = torch.nn.BatchNorm1d(3)
    expected = reference(x)
    for rank in range(2):
        result = json.loads((tmp_path / f"bn-{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(result["out"]), expected.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(result["mean"]), reference.running_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(result["var"]), reference.running_var, rtol=1e-4, atol=1e-4)


def test_per_call_timeout_of_communication_options(tmp_path):
    code, output = _launch("per_call_timeout.py", [])
    assert code == 7, output
    assert "[worker-0] timed out: all_reduce failed on worker:0" in output
    assert "no answer within 1s" in output
