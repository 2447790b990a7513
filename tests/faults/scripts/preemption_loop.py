"""A custom loop driven by PreemptionCheckpointHandler.run, one task of a MultiWorkerMirrored cluster.

usage: preemption_loop.py CKPT_DIR OUT_FILE MODE SLEEP_SECONDS

MODE: ``sigterm`` (SIGTERM is the notice), ``grace`` (the same with a grace period of 3 s),
``watcher`` (worker 1's termination_watcher_fn fires once CKPT_DIR/../notice exists),
``error`` (worker 1's step 40 raises ValueError).
SLEEP_SECONDS: a pause after each step (it changes no number; it keeps the run long enough
for the test to interrupt it mid-way). Every 10 steps each task writes its step count to
CKPT_DIR/../progress-<rank>. The chief writes the final weights to OUT_FILE.
"""

import os
import sys
import time

import torch
from torch import nn

import phalanx
from phalanx.experimental import PreemptionCheckpointHandler, TerminationConfig

STEPS, GLOBAL_BATCH = 300, 8

ckpt_dir, out_file, mode, pause = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
folder = os.path.dirname(os.path.abspath(ckpt_dir))
strategy = phalanx.MultiWorkerMirroredStrategy()
rank, workers = strategy.worker_rank, strategy.num_workers_in_sync

g = torch.Generator().manual_seed(7)
data = torch.randn(STEPS, GLOBAL_BATCH, 5, generator=g)
targets = torch.randn(STEPS, GLOBAL_BATCH, 1, generator=g)
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    checkpoint = phalanx.checkpoint.Checkpoint(model=model, optimizer=optimizer)
    watcher_fn = None
    if mode == "watcher" and rank == 1:
        watcher_fn = lambda: os.path.exists(os.path.join(folder, "notice"))  # noqa: E731
    config = TerminationConfig(termination_watcher_fn=watcher_fn, grace_period=3 if mode == "grace" else None)
    handler = PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, ckpt_dir, config)
print(f"starting at run call {handler.total_run_calls}", flush=True)


def train_step(step):
    rows = slice(rank * GLOBAL_BATCH // workers, (rank + 1) * GLOBAL_BATCH // workers)  # this worker's share
    x, y = data[step, rows], targets[step, rows]

    def replica_step():
        if mode == "error" and rank == 1 and step == 40:
            raise ValueError(f"bad batch {step}")
        loss = (model(x) - y).square().sum() / GLOBAL_BATCH
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return strategy.reduce("SUM", strategy.run(replica_step), axis=None)


for step in range(handler.total_run_calls, STEPS):
    handler.run(train_step, step)
    if step % 10 == 0:
        with open(os.path.join(folder, f"progress-{rank}"), "w") as f:
            f.write(str(step))
    time.sleep(pause)

if strategy.is_chief:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out_file)
print("done", flush=True)
