"""What the stall inspector costs MultiWorkerMirroredStrategy: 2 processes, inspector on vs off.

Run: python benchmarks/bench_stall_inspector.py [--quick]

The inspector's hot-path work is signing each collective (its call site, shapes, a counter)
and noting the wait; its states ride on the heartbeat thread once a second either way. Both
sides run in the same processes, in alternating rounds, by switching that hot-path work on
and off (the settings of the strategy's `CollectiveWatch`); the best round of each counts.

1. A 4 KB all-reduce through the strategy's cross-worker path (where a fixed cost per call
   shows most).
2. The training loop of bench_multiworker.py (MLP 784-1024-1024-10, global batch 256, gradient
   buckets).

ratio = time off / time on (1.00 = free). Nothing is asserted. On a loaded machine the rounds
are noisy: compare ratios only from a quiet machine, and expect a few percent either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_multiworker import GLOBAL_BATCH, _best_alternating, _mlp  # noqa: E402


def _switched(strategy, enabled: bool, fn):
    """``fn`` run with the inspector's hot-path work on or off."""
    watch = strategy._group._watch
    settings = dataclasses.replace(watch.settings, enabled=enabled)

    def call() -> object:
        previous, watch.settings = watch.settings, settings
        try:
            return fn()
        finally:
            watch.settings = previous

    return call


def _training_epoch(strategy, quick: bool):
    import phalanx

    steps = 8 if quick else 25
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(GLOBAL_BATCH, 784, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]
    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = strategy.experimental_distribute_dataset(
        data, phalanx.InputOptions(experimental_fetch_to_device=False)
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def epoch() -> None:
        for x, y in dataset:
            strategy.run(step, args=(x, y))

    return epoch, GLOBAL_BATCH * steps


def worker(quick: bool) -> None:
    import phalanx

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Auto-sharding found no files")
    strategy = phalanx.MultiWorkerMirroredStrategy()
    small = torch.ones(1 << 10)
    reduce = lambda: strategy.cross_worker_all_reduce(small, "sum")  # noqa: E731
    on, off = _best_alternating(
        _switched(strategy, True, reduce), _switched(strategy, False, reduce), 200 if quick else 1000, 5
    )
    lines = [
        f"allreduce 4KB  inspector on {on * 1e6:7.1f} us   off {off * 1e6:7.1f} us   "
        f"ratio {off / on:5.2f}   (off/on; 1.00 = free)"
    ]
    epoch, examples = _training_epoch(strategy, quick)
    on, off = _best_alternating(_switched(strategy, True, epoch), _switched(strategy, False, epoch), 1, 5)
    lines.append(
        f"MLP training   inspector on {examples / on:7.0f} ex/s   off {examples / off:7.0f} ex/s   "
        f"ratio {off / on:5.2f}   (on/off throughput; 1.00 = free)"
    )
    if strategy.cluster_resolver.worker_index == 0:
        print("\n".join(lines), flush=True)
    strategy.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.quick)
        return 0
    from phalanx.cluster import launch

    return launch(
        os.path.abspath(__file__),
        workers=2,
        args=["--worker"] + (["--quick"] if args.quick else []),
        timeout=600,
    )


if __name__ == "__main__":
    sys.exit(main())
