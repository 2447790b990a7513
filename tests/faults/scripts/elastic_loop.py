"""A custom loop driven by PreemptionCheckpointHandler.run under an elastic
MultiWorkerMirroredStrategy (phalanx launch --min-workers); a chosen worker SIGKILLs itself in
the middle of a step (after its forward pass, before its gradients are all-reduced).

usage: elastic_loop.py OUT_DIR KILL_RANK KILL_AT_STEP [PAUSE]

The data, model and step are _custom_loop's (the global batch split among the workers there
are at each step). Every worker writes OUT_DIR/weights-<rank>-<incarnation>.pt.
"""

import os
import signal
import sys
import time

import torch
from _custom_loop import build, data, train_step_of, weights

import phalanx
from phalanx.experimental import PreemptionCheckpointHandler

STEPS, GLOBAL_BATCH = 120, 12

out_dir, kill_rank, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = int(os.environ.get("RANK", "0"))
incarnation = int(os.environ.get("PHALANX_ELASTIC_INCARNATION", "0"))

inputs, targets = data(STEPS, GLOBAL_BATCH)
with strategy.scope():
    model, optimizer, checkpoint = build(strategy)
    folder = os.path.join(out_dir, "ckpt")
    handler = PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, folder)


def kill_mid_step(step):
    if rank == kill_rank and incarnation == 0 and step == kill_at:
        with open(os.path.join(out_dir, "killed-at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


train_step = train_step_of(strategy, model, optimizer, inputs, targets, kill_mid_step)
times = []
while handler.total_run_calls < STEPS:
    handler.run(train_step, handler.total_run_calls)
    times.append(time.time())
    time.sleep(pause)

torch.save(
    {
        "weights": weights(model),
        "times": times,
        "run_calls": handler.total_run_calls,
        "workers": strategy.num_workers_in_sync,
    },
    os.path.join(out_dir, f"weights-{rank}-{incarnation}.pt"),
)
strategy.close()
