"""Trains under MultiWorkerMirroredStrategy until killed; one worker sends itself a signal at a step.

The survivor writes "<seconds since that step began>\\n<error message>" to OUT_DIR/error-<rank>.txt.

usage: train_forever.py SIGNAL_RANK SIGNAL_STEP OUT_DIR [SIGNAL (KILL or STOP)]
"""

import os
import signal
import sys
import time

import torch
from torch import nn

import phalanx
from phalanx.communication.group.worker_group import PeerUnavailableError

signal_rank, signal_step, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
signum = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}[sys.argv[4] if len(sys.argv) > 4 else "KILL"]
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
died_at = time.time()
try:
    for i in range(100000):
        if rank == signal_rank and i == signal_step:
            os.kill(os.getpid(), signum)
        if i == signal_step:
            died_at = time.time()
        strategy.run(step, args=(x,))
except PeerUnavailableError as exc:
    with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
        f.write(f"{time.time() - died_at:.3f}\n{exc}")
    raise
