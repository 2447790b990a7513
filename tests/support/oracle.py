"""The problem the TF reference trajectories were recorded on (tests/parity/oracles/README.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

import phalanx

# The trajectories live in the repository; PHALANX_ORACLES points elsewhere (e.g. a fresh recording).
ORACLES = Path(os.environ.get("PHALANX_ORACLES", Path(__file__).resolve().parents[1] / "parity" / "oracles"))
GLOBAL_BATCH = 32
WEIGHT_TOL = {"rtol": 1e-5, "atol": 1e-6}
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}


def dataset(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.load(ORACLES / "dataset.npz")
    return torch.from_numpy(data["x"][:n]), torch.from_numpy(data["y"][:n])


def reference(case: str) -> tuple[dict[str, np.ndarray], dict]:
    npz = np.load(ORACLES / f"{case}.npz")
    meta = json.loads((ORACLES / f"{case}.json").read_text())
    return {k: npz[k] for k in npz.files}, meta


class OracleNet(nn.Module):
    """Linear(20→32) → ReLU → Linear(32→10) logits, initialised from init_weights.npz."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 10)
        init = np.load(ORACLES / "init_weights.npz")
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.from_numpy(init[f"torch/{name}"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batches(n: int = 256, with_index: bool = False) -> list:
    """Global batches of 32 in order, last partial batch kept (optionally with example indices)."""
    x, y = dataset(n)
    idx = torch.arange(n)
    out = []
    for i in range(0, n, GLOBAL_BATCH):
        b = (x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH])
        out.append((*b, idx[i : i + GLOBAL_BATCH]) if with_index else b)
    return out


def run_ctl(strategy: phalanx.Strategy, n: int = 256, global_batch_size: int | None = GLOBAL_BATCH):
    """The guide's custom training loop; returns (losses, state_dict, indices per step per replica)."""
    with strategy.scope():
        model = OracleNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dist = strategy.experimental_distribute_dataset(batches(n, with_index=True))

    def step(x, y, idx):
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = phalanx.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss, idx

    losses, seen = [], []
    for x, y, idx in dist:
        loss, idx_out = strategy.run(step, args=(x, y, idx))
        losses.append(strategy.reduce(phalanx.ReduceOp.SUM, loss, axis=None).item())
        seen.append([t.tolist() for t in strategy.experimental_local_results(idx_out)])
    return np.array(losses), model.state_dict(), seen
