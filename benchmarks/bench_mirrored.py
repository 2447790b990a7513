"""MirroredStrategy over 2 logical CPU replicas against OneDeviceStrategy at the same global batch.

Run: python benchmarks/bench_mirrored.py [--quick]
Goal: throughput ratio (mirrored / one device) >= 0.9 on a 2-core machine, MLP
784-1024-1024-10, global batch 256; also prints the per-`run` overhead in microseconds.
Goal: a tiny transformer (hidden 32, 2 layers, vocab 100, global batch 8, sequence
16) steps under Mirrored(2 CPU replicas) within 1.2x of one device's step time: modules read
the replica's plain tensors, so no per-op Python dispatch runs inside a replica.
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


class TinyTransformer(nn.Module):
    """Embedding, 2 pre-norm blocks (nn.MultiheadAttention + MLP) and a vocabulary head."""

    def __init__(self, vocab: int = 100, hidden: int = 32, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.attn = nn.ModuleList(
            nn.MultiheadAttention(hidden, heads, batch_first=True) for _ in range(layers)
        )
        self.norm = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(2 * layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp, strict=True)):
            x = self.norm[2 * i](h)
            h = h + attn(x, x, x, need_weights=False)[0]
            h = h + mlp(self.norm[2 * i + 1](h))
        return self.head(h)


def transformer_step_time(strategy, steps: int) -> float:
    """Seconds of the fastest training step of TinyTransformer (global batch 8, sequence 16):
    the minimum, not the mean, so that other load on a shared machine does not decide it."""
    torch.manual_seed(0)
    with strategy.scope():
        model = TinyTransformer()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (8, 16))

    def step(xb):
        logits = model(xb[:, :-1])
        losses = nn.functional.cross_entropy(logits.transpose(1, 2), xb[:, 1:], reduction="none").mean(1)
        loss = phalanx.compute_average_loss(losses, global_batch_size=8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    batches = iter(strategy.experimental_distribute_dataset([ids] * (steps + 3)))
    for _ in range(3):
        strategy.run(step, args=(next(batches),))
    best = float("inf")
    for batch in batches:
        start = time.perf_counter()
        strategy.run(step, args=(batch,))
        best = min(best, time.perf_counter() - start)
    return best


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
    steps = 30 if args.quick else 100
    t_one, t_mirrored = transformer_step_time(one, steps), transformer_step_time(mirrored, steps)
    t_one, t_mirrored = (
        min(t_one, transformer_step_time(one, steps)),
        min(t_mirrored, transformer_step_time(mirrored, steps)),
    )
    print(
        f"{'tiny transformer step (h32, 2 layers, batch 8, seq 16)':<52} mirrored {1e3 * t_mirrored:8.2f} ms"
        f"   one device {1e3 * t_one:8.2f} ms   time ratio {t_mirrored / t_one:6.2f} (goal <= 1.2)",
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
