"""A transport registered by the program (one module and one registry line) carries every
collective of MultiWorkerMirrored training, and the job ends at one device's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx
from support.cluster import run_cluster

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"


def _one_device():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(64, 8, generator=generator)
    labels = torch.randint(0, 3, (64,), generator=generator)
    losses = []
    for start in range(0, 64, 16):
        x, y = features[start : start + 16], labels[start : start + 16]
        loss = phalanx.compute_average_loss(nn.functional.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_a_registered_transport_carries_multi_worker_training(tmp_path):
    run_cluster(SCRIPTS / "transport_training.py", tmp_path, workers=2, timeout=180).check()
    losses, weights = _one_device()
    for rank in range(2):
        result = json.loads((tmp_path / f"transport-{rank}.json").read_text())
        assert result["transport"] == "store"
        # the initial broadcast, the gradient buckets and the end-of-data agreement all went through it
        assert result["calls"].get("all_reduce", 0) >= 4
        assert result["calls"].get("broadcast", 0) >= 1
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
        for name, value in weights.items():
            torch.testing.assert_close(torch.tensor(result["weights"][name]), value, rtol=1e-5, atol=1e-6)
