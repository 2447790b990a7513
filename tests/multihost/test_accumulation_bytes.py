"""Gradient accumulation moves a quarter of the bytes, counted on the wire between two hosts.

Four synchronised steps of global batch 64 against the same four batches as micro-batches of
one update (the first three under ``strategy.no_sync()``): each worker's network namespace
counts what it sent. The accumulated update is the update of the one batch of 256.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from multihost.cluster import start_workers, wait_all

pytestmark = pytest.mark.multihost


def _one_batch_update(start, xs, ys):
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 10))
    model.load_state_dict(start)
    nn.functional.cross_entropy(model(xs), ys).backward()
    with torch.no_grad():
        return {n: p - 0.1 * p.grad for n, p in model.named_parameters()}


def test_accumulating_four_micro_batches_moves_a_quarter_of_the_bytes(make_hosts, tmp_path):
    hosts = make_hosts(2)
    codes, output = wait_all(start_workers(hosts, "accumulate_bytes.py", [tmp_path]), timeout=180)
    assert codes == [0, 0], output
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(4)
    ]
    xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    for rank in range(2):
        sent = json.loads((tmp_path / f"bytes-{rank}.json").read_text())
        gradient_bytes = (784 * 1024 + 1024 + 1024 * 10 + 10) * 4
        assert sent["steps"] >= 4 * gradient_bytes  # one all-reduce of every gradient per step
        assert sent["accumulated"] <= 0.4 * sent["steps"], sent
        weights = torch.load(tmp_path / f"weights-{rank}.pt")
        expected = _one_batch_update(
            {k.replace("module.", ""): v for k, v in weights["start"].items()}, xs, ys
        )
        for name, value in expected.items():
            torch.testing.assert_close(weights["end"][name], value, rtol=1e-5, atol=1e-6)
