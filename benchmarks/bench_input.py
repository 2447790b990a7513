"""Input pipeline: `phalanx.data.Dataset` batching against a plain PyTorch DataLoader.

Run: python benchmarks/bench_input.py [--quick]
One epoch of 60000 rows x 784 floats in batches of 256, plain and shuffled. The reference is
`torch.utils.data.DataLoader` over a `TensorDataset` (the usual PyTorch pipeline; it collates
row by row) and, as a floor, slicing the tensors by hand.

Then a `Dataset` with a CPU-heavy ``map`` read through a DataLoader with 0 and 2 workers:
the map calls of one pass are counted across the worker processes (2 workers must make the
calls of one pass, not two) and the epoch times compared.
"""

from __future__ import annotations

import argparse
import multiprocessing

import torch
from _timing import best_time, report
from torch.utils.data import DataLoader, TensorDataset

from phalanx.data import Dataset

ROWS, BATCH = 60000, 256
MAP_ROWS, MAP_WORK = 4096, 16  # the map benchmark: rows, and matmuls of 64 x 64 per row


class _CountedMap:
    """A CPU-heavy map whose calls are counted across DataLoader worker processes (fork)."""

    def __init__(self) -> None:
        self.calls = multiprocessing.get_context("fork").Value("l", 0)
        self._weight = torch.randn(64, 64) / 8

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self.calls.get_lock():
            self.calls.value += 1
        h = x[:64].reshape(1, 64)
        for _ in range(MAP_WORK):
            h = torch.tanh(h @ self._weight)
        return h.reshape(64), y


def _map_pass(x: torch.Tensor, y: torch.Tensor, workers: int) -> tuple[float, int]:
    """One pass of ``from_tensor_slices.map(heavy).batch`` through a DataLoader: (seconds, map calls)."""
    counted = _CountedMap()
    ds = Dataset.from_tensor_slices((x[:MAP_ROWS], y[:MAP_ROWS])).map(counted).batch(BATCH)
    loader = DataLoader(
        ds, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None
    )
    seconds = best_time(lambda: _epoch(loader), 1, 1)
    return seconds, counted.calls.value


def _bench_map_workers(x: torch.Tensor, y: torch.Tensor) -> None:
    serial, serial_calls = _map_pass(x, y, 0)
    two, two_calls = _map_pass(x, y, 2)
    print(
        f"DataLoader map calls in one pass of {MAP_ROWS} rows: 0 workers {serial_calls}, "
        f"2 workers {two_calls} (each element mapped {two_calls / MAP_ROWS:.2f} times)",
        flush=True,
    )
    report(f"map(heavy).batch({BATCH}), DataLoader 2 workers", two, serial, unit="ms", ref_name="0 workers")
    if two_calls != MAP_ROWS:
        raise SystemExit(f"2 DataLoader workers made {two_calls} map calls for {MAP_ROWS} rows")


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

    _bench_map_workers(x, y)


if __name__ == "__main__":
    main()
