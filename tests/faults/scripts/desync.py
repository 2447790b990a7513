"""One worker makes a collective the other does not, in the middle of training: every worker
must raise `CollectiveMismatchError` at that collective, before any of its results is used.

Every step prints ``STEP <i> <checksum of the weights after it>``; at the mismatch each worker
prints ``MISMATCH <steps completed> <checksum of its weights now> <message>`` and exits 1.

usage: desync.py MODE [STEPS]
  reduce          worker:1 logs with strategy.reduce at step DIVERGE (a rank-conditional log line)
  gather          worker:1 calls strategy.gather at step DIVERGE
  user_all_reduce worker:1 calls torch.distributed.all_reduce at step DIVERGE
  broadcast       worker:1 calls torch.distributed.broadcast at step DIVERGE
  extra_backward  worker:1 runs backward twice at step DIVERGE
  shapes          worker:1 builds its model with another hidden width
  in_backward     worker:1 calls torch.distributed.all_reduce inside backward at step DIVERGE,
                  between two gradient buckets (one bucket per tensor)
  in_backward_all every worker does so at every step: no mismatch (``plain``: nobody does;
                  both with the same buckets, so their weights must agree)
  between_passes  no log line; worker:1 calls strategy.reduce before step DIVERGE, where gloo
                  has the step's gradient all-reduces announced by the step before's
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.errors import CollectiveMismatchError

MODE = sys.argv[1]
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
DIVERGE = 5
IN_BACKWARD = MODE in ("in_backward", "in_backward_all", "plain")
BETWEEN = MODE == "between_passes"
# a bucket per tensor: the last layer's weight is the first all-reduce of a backward pass; the
# first layer's weight does not fit in gloo's first message, so gloo announces the pass's
# all-reduces (phalanx.communication.transports.gloo.transport) and the collective inside breaks that
options = phalanx.CommunicationOptions(bytes_per_pack=64) if IN_BACKWARD or BETWEEN else None
strategy = phalanx.MultiWorkerMirroredStrategy(communication_options=options)
rank = strategy.cluster_resolver.worker_index
hidden = 256 if IN_BACKWARD or BETWEEN else 17 if MODE == "shapes" and rank == 1 else 16
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def checksum():
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def stray(step):
    """The collective only worker:1 makes."""
    if rank != 1 or step != DIVERGE:
        return
    if MODE in ("reduce", "between_passes"):
        strategy.reduce("SUM", strategy.run(lambda: torch.ones(())), axis=None)
    elif MODE == "gather":
        strategy.gather(strategy.run(lambda: torch.ones(3)), axis=0)
    elif MODE == "user_all_reduce":
        dist.all_reduce(torch.ones(3))
    elif MODE == "broadcast":
        dist.broadcast(torch.ones(2), src=0)


def in_backward(step):
    """Whether this worker all-reduces inside this step's backward pass."""
    return MODE == "in_backward_all" or (MODE == "in_backward" and rank == 1 and step == DIVERGE)


def all_reduce_in_backward(param):
    if in_backward(current_step):
        dist.all_reduce(torch.ones(3))


if IN_BACKWARD:  # after the first gradient all-reduce of the pass started, before the others
    model[2].weight.register_post_accumulate_grad_hook(all_reduce_in_backward)
current_step = 0


def train_step(x, extra):
    loss = model(x).square().mean()
    loss.backward()  # the gradient all-reduces
    if extra:
        model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


done = 0
try:
    for step in range(STEPS):
        current_step = step
        stray(step)
        extra = MODE == "extra_backward" and rank == 1 and step == DIVERGE
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = strategy.run(train_step, args=(x, extra))
        if not BETWEEN:
            strategy.reduce("SUM", loss, axis=None)  # logging: every worker, every step
        done = step + 1
        if step < 20 or step % 1000 == 0:
            print(f"STEP {step} {checksum():.10g}", flush=True)
    strategy.close()
except CollectiveMismatchError as exc:
    print(f"MISMATCH {done} {checksum():.10g} {exc}", flush=True)
    sys.exit(1)
print("finished without an error", flush=True)
