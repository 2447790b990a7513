"""Bytes on the link for the same 256 examples: 4 synchronised steps of global batch 64 against
4 micro-batches of 64 accumulated under ``strategy.no_sync()`` (one update).

Each worker runs on a host of its own, so what its network namespace sent (``/proc/net/dev``,
every interface but lo) is what crossed the wire. Writes OUT_DIR/bytes-<rank>.json with both
counts and the accumulated update's weights.

usage: accumulate_bytes.py OUT_DIR
"""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import phalanx
from multihost.hosts import sent_bytes

GLOBAL_BATCH, MICRO = 64, 4


out_dir = sys.argv[1]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
data = [
    (torch.randn(GLOBAL_BATCH, 784, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
    for _ in range(MICRO)
]
dataset = strategy.experimental_distribute_dataset(data)


def backward(x, y, scale):
    per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
    (phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH) / scale).backward()


def update():
    optimizer.step()
    optimizer.zero_grad()


def counted(loop):
    dist.barrier()
    before = sent_bytes()
    loop()
    dist.barrier()
    return sent_bytes() - before


def synchronised():
    for x, y in dataset:
        strategy.run(lambda x, y: (backward(x, y, 1), update()), args=(x, y))


def accumulated():
    for i, (x, y) in enumerate(dataset):
        last = i == MICRO - 1
        with contextlib.nullcontext() if last else strategy.no_sync():
            strategy.run(backward, args=(x, y, MICRO))
    strategy.run(update)


synchronised()  # warm up: the buckets are built, the passes announced
steps = counted(synchronised)
start = {name: p.detach().clone() for name, p in model.named_parameters()}
accumulation = counted(accumulated)
with open(os.path.join(out_dir, f"bytes-{rank}.json"), "w") as f:
    json.dump({"steps": steps, "accumulated": accumulation}, f)
torch.save(
    {"start": start, "end": {n: p.detach().clone() for n, p in model.named_parameters()}},
    os.path.join(out_dir, f"weights-{rank}.pt"),
)
print("done", rank, flush=True)
strategy.close()
