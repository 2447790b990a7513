"""Per-step overhead of `strategy.run` + `strategy.reduce` against the same plain PyTorch loop.

Run: python benchmarks/bench_overhead.py [--quick]
Goal (issue 2): time ratio (phalanx / plain) <= 1.05 under the default strategy and
OneDeviceStrategy on a small MLP.
"""

from __future__ import annotations

import argparse

import torch
from _timing import best_time, report
from torch import nn

import phalanx


def _setup(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    return model, optimizer, x, y


def plain_step(model, optimizer, x, y):
    loss = nn.functional.cross_entropy(model(x), y, reduction="none").sum() / 64
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats, inner = (5, 200) if args.quick else (10, 1000)
    torch.set_num_threads(1)

    model, optimizer, x, y = _setup(phalanx.get_strategy())
    reference = best_time(lambda: plain_step(model, optimizer, x, y), repeats, inner)

    for name, strategy in (
        ("default", phalanx.get_strategy()),
        ("one_device", phalanx.OneDeviceStrategy("cpu")),
    ):
        model, optimizer, x, y = _setup(strategy)

        def step(model=model, optimizer=optimizer, x=x, y=y):
            per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
            loss = phalanx.compute_average_loss(per_example, global_batch_size=64)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        def phalanx_step(strategy=strategy, step=step):
            return strategy.reduce("sum", strategy.run(step), axis=None)

        ours = best_time(phalanx_step, repeats, inner)
        plain = _setup(phalanx.get_strategy())
        reference = min(reference, best_time(lambda plain=plain: plain_step(*plain), repeats, inner))
        report(f"run+reduce overhead, small MLP, {name}", ours, reference, ref_name="plain torch")


if __name__ == "__main__":
    main()
