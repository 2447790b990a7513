"""A custom loop driven by PreemptionCheckpointHandler.run under an elastic
MultiWorkerMirroredStrategy (phalanx launch --min-workers); a chosen worker SIGKILLs itself in
the middle of a step (after its forward pass, before its gradients are all-reduced).

usage: elastic_loop.py OUT_DIR KILL_RANK KILL_AT_STEP [PAUSE]

Every step's global batch is fixed by the step number and split among the workers there are
at that step; the loss is divided by the global batch, so the weights do not depend on how
many workers computed them. Every worker writes OUT_DIR/weights-<rank>-<incarnation>.pt.
"""

import os
import signal
import sys
import time

import torch
from torch import nn

import phalanx
from phalanx.experimental import PreemptionCheckpointHandler

STEPS, GLOBAL_BATCH = 120, 12

out_dir, kill_rank, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = int(os.environ.get("RANK", "0"))
incarnation = int(os.environ.get("PHALANX_ELASTIC_INCARNATION", "0"))

g = torch.Generator().manual_seed(7)
data = torch.randn(STEPS, GLOBAL_BATCH, 5, generator=g)
targets = torch.randn(STEPS, GLOBAL_BATCH, 1, generator=g)
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    checkpoint = phalanx.checkpoint.Checkpoint(model=model, optimizer=optimizer)
    folder = os.path.join(out_dir, "ckpt")
    handler = PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, folder)


def train_step(step):
    me, workers = strategy.worker_rank, strategy.num_workers_in_sync  # as many as there are now
    rows = slice(me * GLOBAL_BATCH // workers, (me + 1) * GLOBAL_BATCH // workers)
    x, y = data[step, rows], targets[step, rows]

    def replica_step():
        loss = (model(x) - y).square().sum() / GLOBAL_BATCH
        if rank == kill_rank and incarnation == 0 and step == kill_at:
            with open(os.path.join(out_dir, "killed-at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return strategy.reduce("SUM", strategy.run(replica_step), axis=None)


times = []
while handler.total_run_calls < STEPS:
    handler.run(train_step, handler.total_run_calls)
    times.append(time.time())
    time.sleep(pause)

torch.save(
    {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "times": times,
        "run_calls": handler.total_run_calls,
        "workers": strategy.num_workers_in_sync,
    },
    os.path.join(out_dir, f"weights-{rank}-{incarnation}.pt"),
)
strategy.close()
