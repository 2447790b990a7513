"""MirroredStrategy over 2 logical CPU replicas against OneDeviceStrategy at the same global batch.

Run: python benchmarks/bench_mirrored.py [--quick]
Goal (issue 3): throughput ratio (mirrored / one device) >= 0.9 on a 2-core machine, MLP
784-1024-1024-10, global batch 256; also prints the per-`run` overhead in microseconds.
"""

from __future__ import annotations

import argparse
import time

import torch
from _timing import best_time
from torch import nn

import phalanx

GLOBAL_BATCH = 256


def throughput(strategy, steps: int) -> float:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(
            nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(GLOBAL_BATCH, 784), torch.randint(0, 10, (GLOBAL_BATCH,))

    def step(xb, yb):
        loss = phalanx.compute_average_loss(nn.functional.cross_entropy(model(xb), yb, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    batches = iter(strategy.experimental_distribute_dataset([(x, y)] * (steps + 3)))
    for _ in range(3):
        strategy.run(step, args=next(batches))
    start = time.perf_counter()
    for batch in batches:
        strategy.run(step, args=batch)
    return steps * GLOBAL_BATCH / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 10 if args.quick else 40
    one = phalanx.OneDeviceStrategy("cpu")
    mirrored = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    a, b = throughput(one, steps), throughput(mirrored, steps)
    a, b = max(a, throughput(one, steps)), max(b, throughput(mirrored, steps))
    print(
        f"{'MLP 784-1024-1024-10, batch 256, 2 CPU replicas':<52} mirrored {b:8.0f} ex/s   "
        f"one device {a:8.0f} ex/s   throughput ratio {b / a:6.3f} (goal >= 0.9)",
        flush=True,
    )
    repeats, inner = (3, 200) if args.quick else (5, 1000)
    overhead = best_time(lambda: mirrored.run(lambda: None), repeats, inner)
    plain = best_time(lambda: (lambda: None)(), repeats, inner)
    print(
        f"{'per-run overhead, Mirrored 2 replicas, empty fn':<52} {1e6 * (overhead - plain):8.1f} us",
        flush=True,
    )


if __name__ == "__main__":
    main()
