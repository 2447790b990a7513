"""Trains under MultiWorkerMirroredStrategy until a peer is lost; for the partition test.

Writes OUT_DIR/steps-<rank> (the steps done so far) after every step; on PeerUnavailableError,
writes "<time.time()>\\n<message>" to OUT_DIR/error-<rank>.txt and re-raises (exit code 1).

usage: train_until_cut.py OUT_DIR
"""

import os
import sys
import time

import torch
from torch import nn

import phalanx
from phalanx.communication.group.worker_group import PeerUnavailableError

out_dir = sys.argv[1]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def step(x):
    model(x).sum().backward()  # the gradient buckets' all-reduces start here
    optimizer.step()
    optimizer.zero_grad()


x = torch.randn(4, 8)
try:
    for i in range(1_000_000):
        strategy.run(step, args=(x,))
        with open(os.path.join(out_dir, f"steps-{rank}"), "w") as f:
            f.write(str(i + 1))
        time.sleep(0.02)
except PeerUnavailableError as exc:
    with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
        f.write(f"{time.time()}\n{exc}")
    print("lost a peer:", exc, flush=True)
    raise
