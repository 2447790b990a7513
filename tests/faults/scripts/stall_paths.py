"""Two workers that take different paths at one step; the stall inspector must name both sides.

Each worker prints ``STALL <seconds since its last step began> <error message>`` when it raises
`CollectiveMismatchError` (the worker that ran on into ``close`` raises it there, or at exit).

usage: stall_paths.py MODE
  skip_step    worker:1 skips backward and optimizer.step() at step 2 (a one-sided skip after
               a non-finite loss), then logs with strategy.reduce as every step does
  extra_reduce worker:0 alone calls strategy.reduce after the loop (rank-conditional evaluation)
  early_stop   worker:1 stops iterating one batch before worker:0
  fit          worker:0 alone calls strategy.reduce before Model.fit, whose broadcast of the
               new model's initial values worker:1 enters
"""

import sys
import time

import torch
from torch import nn

import phalanx
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError

MODE = sys.argv[1]
STEPS = 4
DIVERGE = 2
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(x, skip):
    loss = model(x).square().mean()
    if skip:  # as a loop that skips a non-finite loss seen on this worker only
        return loss.detach()
    loss.backward()  # the gradient buckets' all-reduces start here
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def custom_loop():
    steps = STEPS - 1 if MODE == "early_stop" and rank == 1 else STEPS
    global start
    for i in range(steps):
        start = time.monotonic()  # the stall is measured from the step it happens in
        skip = MODE == "skip_step" and rank == 1 and i == DIVERGE
        loss = strategy.run(train_step, args=(torch.randn(4, 8), skip))
        strategy.reduce("SUM", loss, axis=None)  # logging: every worker, every step
    start = time.monotonic()
    if MODE == "extra_reduce" and rank == 0:
        strategy.reduce("SUM", torch.ones(3), axis=None)  # "evaluation" on the chief only


def fit():
    if rank == 0:
        strategy.reduce("SUM", torch.ones(3), axis=None)  # "evaluation" on the chief only
    with strategy.scope():
        keras_model = phalanx.Model(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1)))
        keras_model.compile(optimizer="sgd", loss="mse")
    keras_model.fit(torch.randn(16, 8), torch.randn(16, 1), batch_size=8, epochs=1, verbose=0)


start = time.monotonic()
try:
    fit() if MODE == "fit" else custom_loop()
    strategy.close()
except CollectiveMismatchError as exc:
    print(f"STALL {time.monotonic() - start:.1f} {exc}", flush=True)
    raise
print("finished without an error", flush=True)
