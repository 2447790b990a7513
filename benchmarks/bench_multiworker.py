"""MultiWorkerMirroredStrategy over 2 processes against raw torch.distributed (gloo) and DDP.

Run: python benchmarks/bench_multiworker.py [--quick]
Goals (issue 4): all-reduce ratio >= 0.95 at 4 MB and above; MWMS training throughput >=
1.0x DistributedDataParallel on an MLP 784-1024-1024-10, global batch 256, 2 workers x 1 thread.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {"4KB": 1 << 10, "256KB": 1 << 16, "4MB": 1 << 20, "64MB": 1 << 24}  # float32 elements


def _time(fn, repeats):
    dist.barrier()
    fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / repeats


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def worker(quick: bool) -> None:
    import phalanx

    torch.set_num_threads(1)
    strategy = phalanx.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.worker_index
    lines = []
    for name, numel in SIZES.items():
        repeats = max(3, (20 if quick else 100) * (1 << 16) // max(numel, 1 << 16))
        raw_buf, our_buf = torch.ones(numel), torch.ones(numel)
        raw = _time(lambda b=raw_buf: dist.all_reduce(b), repeats)
        ours = _time(lambda b=our_buf: strategy._cross_worker_all_reduce(b, "sum"), repeats)
        lines.append(
            f"all-reduce {name:>6}, 2 processes      phalanx {ours * 1e3:8.3f} ms"
            f"   raw gloo {raw * 1e3:8.3f} ms   speed ratio {raw / ours:6.3f} (goal >= 0.95 from 4MB)"
        )
    steps = 10 if quick else 30
    x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    ddp_model = nn.parallel.DistributedDataParallel(_mlp())
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

    def ddp_step():
        loss = nn.functional.cross_entropy(ddp_model(x), y)  # DDP averages gradients
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()

    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(xb, yb):
        loss = phalanx.compute_average_loss(
            nn.functional.cross_entropy(model(xb), yb, reduction="none"), global_batch_size=256
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    ddp = _time(ddp_step, steps)
    ours = _time(lambda: strategy.run(step, args=(x, y)), steps)
    ddp = min(ddp, _time(ddp_step, steps))
    ours = min(ours, _time(lambda: strategy.run(step, args=(x, y)), steps))
    lines.append(
        f"MLP 784-1024-1024-10, batch 256, 2x1 thread   phalanx {256 / ours:8.0f} ex/s"
        f"   DDP {256 / ddp:8.0f} ex/s   throughput ratio {ddp / ours:6.3f} (goal >= 1.0)"
    )
    if rank == 0:
        print("\n".join(lines), flush=True)
    strategy.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.quick)
        return 0
    sys.path.insert(0, HERE)
    from phalanx.cluster import launch

    return launch(
        os.path.abspath(__file__),
        workers=2,
        args=["--worker"] + (["--quick"] if args.quick else []),
        timeout=600,
    )


if __name__ == "__main__":
    sys.exit(main())
