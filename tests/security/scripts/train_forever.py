"""Trains under MultiWorkerMirroredStrategy until stopped (a `phalanx launch` task).

Once training runs, each task writes OUT_DIR/task-<rank>.json: its pid and the ports of the
cluster. SIGTERM or SIGINT is recorded in OUT_DIR/got-<rank>.txt (proof that the launcher
passed it on) before the task exits with code 1.

usage: train_forever.py OUT_DIR
"""

import json
import os
import signal
import sys

import torch
from torch import nn

import phalanx

out_dir = sys.argv[1]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index


def record(signum, frame):
    with open(os.path.join(out_dir, f"got-{rank}.txt"), "w") as f:
        f.write(signal.Signals(signum).name)
    os._exit(1)


signal.signal(signal.SIGTERM, record)
signal.signal(signal.SIGINT, record)
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def step(x):
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


x = torch.randn(4, 8)
spec = strategy.cluster_resolver.cluster_spec()
ports = [
    int(spec.task_address(job, i).rsplit(":", 1)[1]) for job in spec.jobs for i in spec.task_indices(job)
]
for i in range(10**9):
    strategy.run(step, args=(x,))
    if i == 2:
        tmp = os.path.join(out_dir, f".task-{rank}.json")
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "ports": ports}, f)
        os.rename(tmp, os.path.join(out_dir, f"task-{rank}.json"))
