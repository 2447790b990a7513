"""A group made with ``torch.distributed.new_group()`` (no backend) inside a MultiWorkerMirrored
program: its collectives are signed as the job's are (`phalanx.communication.group.subgroups`).

Every step trains, then all-reduces the loss on the subgroup (every worker) and prints
``STEP <i> <summed loss> <checksum of the weights>``. With ``stray``, worker:1 alone makes
one more subgroup all-reduce (3 numbers) at step DIVERGE: every worker must raise
`CollectiveMismatchError` at that collective, print ``MISMATCH <steps completed> <message>``
and exit 1. With ``lonely`` nobody all-reduces the loss, and worker:1's stray all-reduce
meets nothing on the subgroup (worker:0 waits in the next step's collectives): the stall
inspector names it. ``plain``: no stray collective; both finish, after 10 all-gathers of 4 MiB
on the subgroup whose tensors nothing keeps, printing ``HELD <MiB>``: the resident memory they
left behind (each gloo work the subgroup holds for its threads keeps its input and the 8 MiB
it gathered into; glibc maps every tensor on its own, so freed ones leave nothing). Every
worker first prints ``BACKEND <name of the subgroup's backend>``.

usage: subgroup_collectives.py plain|stray|lonely
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.errors import CollectiveMismatchError
from phalanx.memory import map_large_allocations, resident_bytes

MODE = sys.argv[1]
map_large_allocations()
STEPS, DIVERGE = 8, 5
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
metrics = dist.new_group()  # no backend: the job's (phalanx's), signed
print(f"BACKEND {dist.get_backend(metrics)}", flush=True)
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(x):
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


done = 0
try:
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = strategy.run(train_step, args=(x,))
        if MODE in ("stray", "lonely") and rank == 1 and step == DIVERGE:
            dist.all_reduce(torch.ones(3), group=metrics)  # only this worker: a stray metric sync
        total = loss.clone()
        if MODE != "lonely":
            dist.all_reduce(total, group=metrics)
        done = step + 1
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        print(f"STEP {step} {float(total):.6g} {checksum:.10g}", flush=True)
    if MODE == "plain":
        before = resident_bytes()
        for i in range(10):
            gathered = torch.empty(2 << 20)
            dist.all_gather_into_tensor(gathered, torch.full((1 << 20,), float(i)), group=metrics)
            assert gathered[-1] == i
            del gathered
        print(f"HELD {(resident_bytes() - before) / 2**20:.1f}", flush=True)
    strategy.close()
except CollectiveMismatchError as exc:
    print(f"MISMATCH {done} {exc}", flush=True)
    sys.exit(1)
print("finished without an error", flush=True)
