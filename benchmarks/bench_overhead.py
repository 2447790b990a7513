"""Per-step overhead of the distributed iterator + `strategy.run` + `strategy.reduce` on one device.

Run: python benchmarks/bench_overhead.py [--quick]
The user's loop (``experimental_distribute_dataset``, ``strategy.run`` per step, a
``strategy.reduce`` of each step's loss) against the plain PyTorch loop over the same batches,
so the difference is everything distribution adds to a step: over in-memory batches (a list of
``(x, y)`` tensors, where the plain loop's iteration costs nothing) and over the same batches
from a `phalanx.data` dataset. Times are the thread's CPU time (steadier than wall time on a
busy machine), best of interleaved epochs. A small MLP (64-64-10, batch 32), under the default
strategy and OneDeviceStrategy. Goals: speed ratio (plain / ours) >= 0.95; at most 8 us added
per step.
"""

from __future__ import annotations

import argparse
import time

import torch
from _timing import report
from torch import nn

import phalanx

BATCH, STEPS = 32, 200


def _setup(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, optimizer


def _plain_epoch(dataset) -> float:
    model, optimizer = _setup(phalanx.get_strategy())
    start = time.thread_time()
    for x, y in dataset:
        loss = nn.functional.cross_entropy(model(x), y, reduction="none").sum() / BATCH
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.detach()  # as the phalanx step returns it
    return (time.thread_time() - start) / STEPS


def _phalanx_epoch(strategy, dataset) -> float:
    model, optimizer = _setup(strategy)
    distributed = strategy.experimental_distribute_dataset(dataset)

    def step(x, y):
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = phalanx.compute_average_loss(per_example, global_batch_size=BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    start = time.thread_time()
    for x, y in distributed:
        strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)
    return (time.thread_time() - start) / STEPS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 5 if args.quick else 30
    torch.set_num_threads(1)
    x, y = torch.randn(BATCH * STEPS, 64), torch.randint(0, 10, (BATCH * STEPS,))
    sources = {
        "in-memory": [(x[i : i + BATCH].clone(), y[i : i + BATCH].clone()) for i in range(0, len(x), BATCH)],
        "phalanx.data": phalanx.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
    }
    strategies = {"default": phalanx.get_strategy(), "one_device": phalanx.OneDeviceStrategy("cpu")}
    for source, dataset in sources.items():
        for name, strategy in strategies.items():
            # Interleaved best-of-N: a busy machine slows both sides alike.
            ours = reference = float("inf")
            for _ in range(repeats):
                reference = min(reference, _plain_epoch(dataset))
                ours = min(ours, _phalanx_epoch(strategy, dataset))
            case = f"per-run overhead, {name}, {source}"
            report(case, ours, reference, ref_name="plain torch")
            print(f"{'':44} added per step {(ours - reference) * 1e6:6.1f} us (goal <= 8 us)", flush=True)


if __name__ == "__main__":
    main()
