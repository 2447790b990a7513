"""Input pipeline: `phalanx.data.Dataset` batching against a plain PyTorch DataLoader.

Run: python benchmarks/bench_input.py [--quick]
One epoch of 60000 rows x 784 floats in batches of 256, plain and shuffled. The reference is
`torch.utils.data.DataLoader` over a `TensorDataset` (the usual PyTorch pipeline; it collates
row by row) and, as a floor, slicing the tensors by hand.
"""

from __future__ import annotations

import argparse

import torch
from _timing import best_time, report
from torch.utils.data import DataLoader, TensorDataset

from phalanx.data import Dataset

ROWS, BATCH = 60000, 256


def _epoch(batches) -> None:
    for _ in batches:  # batches are dropped as we go, as in training
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    torch.set_num_threads(1)
    x, y = torch.randn(ROWS, 784), torch.arange(ROWS)
    ds = Dataset.from_tensor_slices((x, y))
    loader = TensorDataset(x, y)

    ours = best_time(lambda: _epoch(ds.batch(BATCH)), repeats, 1)
    by_hand = best_time(
        lambda: _epoch((x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, ROWS, BATCH)), repeats, 1
    )
    report("batch(256), epoch of 60000", ours, by_hand, unit="ms", ref_name="slicing")
    reference = best_time(lambda: _epoch(DataLoader(loader, batch_size=BATCH)), repeats, 1)
    report("batch(256), epoch of 60000", ours, reference, unit="ms", ref_name="DataLoader")

    ours = best_time(lambda: _epoch(ds.shuffle(ROWS, seed=0).batch(BATCH)), repeats, 1)
    reference = best_time(lambda: _epoch(DataLoader(loader, batch_size=BATCH, shuffle=True)), repeats, 1)
    report("shuffle(60000).batch(256), epoch", ours, reference, unit="ms", ref_name="DataLoader")


if __name__ == "__main__":
    main()
