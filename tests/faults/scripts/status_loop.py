"""A custom loop for the status page's test, under an elastic MultiWorkerMirroredStrategy
(phalanx launch --min-workers 1 --status HOST:PORT): one worker is slowed by a sleep in every
step (after its forward pass, before its gradients are all-reduced), so the other waits for it
in the gradient all-reduce. The workers step until OUT_DIR/stop exists (the test makes it once
only one worker is left), at most MAX_STEPS steps.

usage: status_loop.py OUT_DIR SLOW_TASK SLOW_SECONDS
"""

import os
import sys
import time

from _custom_loop import build, data, train_step_of

import phalanx
import phalanx.status
from phalanx.experimental import PreemptionCheckpointHandler

STEPS, GLOBAL_BATCH, MAX_STEPS, PAUSE = 50, 12, 5000, 0.02

out_dir, slow_task, slow_seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
strategy = phalanx.MultiWorkerMirroredStrategy()
task = int(os.environ["RANK"])  # the task's index (its rank in an elastic job may change)
phalanx.status.expect_steps(MAX_STEPS)

inputs, targets = data(STEPS, GLOBAL_BATCH)
with strategy.scope():
    model, optimizer, checkpoint = build(strategy)
    folder = os.path.join(out_dir, "ckpt")
    handler = PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, folder)


def slow_down(step):
    if task == slow_task:
        time.sleep(slow_seconds)


train_step = train_step_of(strategy, model, optimizer, inputs, targets, slow_down)
stop = os.path.join(out_dir, "stop")
while handler.total_run_calls < MAX_STEPS and not os.path.exists(stop):
    handler.run(train_step, handler.total_run_calls % STEPS)
    time.sleep(PAUSE)  # a step of a few milliseconds: the job would end before the test looks
strategy.close()
