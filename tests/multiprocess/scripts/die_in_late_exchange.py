"""Trains one of two models under MultiWorkerMirroredStrategy; at a step far into the run worker
1 also goes through the other (a bucket no worker expected) and is SIGKILLed inside the
exchange that sums it after the others. The survivor, which learnt of that bucket from the
flags, waits for it there and writes "<seconds since that step began>\\n<error message>" to
OUT_DIR/error-0.txt.

usage: die_in_late_exchange.py STEP OUT_DIR
"""

import os
import signal
import sys
import time

import torch
from torch import nn

import phalanx
from phalanx.communication.group.worker_group import PeerUnavailableError

late_step, out_dir = int(sys.argv[1]), sys.argv[2]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
with strategy.scope():
    idle = nn.Linear(16, 1 << 14)  # 1 MiB of weights: a bucket of its own, not expected after 2 steps
    trained = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.01)


def step(x, through_idle):
    loss = trained(x).sum()
    if through_idle:
        loss = loss + idle(x).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def die(buckets):  # worker 1's late exchange: killed before it starts its all-reduce
    os.kill(os.getpid(), signal.SIGKILL)


x = torch.randn(4, 16)
started = time.time()
try:
    for i in range(100000):
        surprise = i == late_step and rank == 1
        if surprise:
            strategy._buckets._launch_late = die  # the test's reach into the engine
        if i == late_step:
            started = time.time()
        strategy.run(step, args=(x, surprise))
except PeerUnavailableError as exc:
    with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
        f.write(f"{time.time() - started:.3f}\n{exc}")
    raise
