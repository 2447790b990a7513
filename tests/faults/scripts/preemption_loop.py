"""A custom loop driven by PreemptionCheckpointHandler.run, one task of a MultiWorkerMirrored cluster.

usage: preemption_loop.py CKPT_DIR OUT_FILE MODE SLEEP_SECONDS

MODE: ``sigterm`` (SIGTERM is the notice), ``grace`` (the same with a grace period of 3 s),
``watcher`` (worker 1's termination_watcher_fn fires once CKPT_DIR/../notice exists),
``error`` (worker 1's step 40 raises ValueError), ``outside`` (as ``sigterm``, with the handler
made after the ``with strategy.scope():`` block).
SLEEP_SECONDS: a pause after each step (it changes no number; it keeps the run long enough
for the test to interrupt it mid-way). Every 10 steps each task writes its step count to
CKPT_DIR/../progress-<rank>. The chief writes the final weights to OUT_FILE.
"""

import os
import sys
import time

import torch
from _custom_loop import build, data, train_step_of, weights

import phalanx
from phalanx.experimental import PreemptionCheckpointHandler, TerminationConfig

STEPS, GLOBAL_BATCH = 150, 8

ckpt_dir, out_file, mode, pause = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
folder = os.path.dirname(os.path.abspath(ckpt_dir))
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.worker_rank

inputs, targets = data(STEPS, GLOBAL_BATCH)
with strategy.scope():
    model, optimizer, checkpoint = build(strategy)
    watcher_fn = None
    if mode == "watcher" and rank == 1:
        watcher_fn = lambda: os.path.exists(os.path.join(folder, "notice"))  # noqa: E731
    config = TerminationConfig(termination_watcher_fn=watcher_fn, grace_period=3 if mode == "grace" else None)
    if mode != "outside":
        handler = PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, ckpt_dir, config)
if mode == "outside":  # made after the scope block, as TensorFlow allows: it finds the strategy by resolver
    handler = PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, ckpt_dir, config)
print(f"starting at run call {handler.total_run_calls}", flush=True)


def bad_batch(step):
    if mode == "error" and rank == 1 and step == 40:
        raise ValueError(f"bad batch {step}")


train_step = train_step_of(strategy, model, optimizer, inputs, targets, bad_batch)
for step in range(handler.total_run_calls, STEPS):
    handler.run(train_step, step)
    if step % 10 == 0:
        with open(os.path.join(folder, f"progress-{rank}"), "w") as f:
            f.write(str(step))
    time.sleep(pause)

if strategy.is_chief:
    torch.save(weights(model), out_file)
print("done", flush=True)
