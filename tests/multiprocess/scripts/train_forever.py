"""Trains under MultiWorkerMirroredStrategy until killed; a given worker SIGKILLs itself at a step.

usage: train_forever.py KILL_RANK KILL_STEP OUT_DIR
"""

import os
import signal
import sys
import time

import torch
from torch import nn

import phalanx
from phalanx.communication.collectives import PeerUnavailableError

kill_rank, kill_step, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
with strategy.scope():
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def step(x):
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


x = torch.randn(4, 8)
try:
    for i in range(100000):
        if rank == kill_rank and i == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == kill_step:
            died_at = time.time()
        strategy.run(step, args=(x,))
except PeerUnavailableError as exc:
    with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
        f.write(f"{time.time() - died_at:.3f}\n{exc}")
    raise
