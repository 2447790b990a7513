"""What a MultiWorkerMirrored job under TLS carries besides the ring's collectives: send/recv
between any two workers, torch groups of some workers, a 2-D DeviceMesh and a 2-stage
pipeline (`phalanx.communication.transports.tls.peers`, `TlsTransport.subgroup`).

``mesh`` (4 workers, mesh ``[[0, 1], [2, 3]]`` of axes ``("pp", "dp")``): writes
``p2p-<rank>.json`` to OUT_DIR with

* ``tags``: worker 0 sends tags 1, 2 then 3 to worker 2 (not its neighbour in the ring),
  which receives them as 3, 1, 2; worker 1 does the same with worker 3 over isend/irecv;
* ``any_source``: worker 0 receives from whichever worker sends (worker 3) and says who;
* ``batch``: ``batch_isend_irecv`` of each worker to rank + 2 and from rank - 2;
* ``pairs``, ``trio``: collectives on ``new_group([0, 2])``/``([1, 3])`` and ``([0, 1, 2])``;
* ``mesh_pp``, ``mesh_dp``: ``rank + 1`` all-reduced along each axis of the DeviceMesh;
* ``pipeline``: one step of a 2-stage pipeline along ``pp`` (activations forward, gradients
  back, point-to-point on the mesh's group), gradients averaged along ``dp``, and the same
  step in this process on the whole model (``reference``).

``missing`` (2 workers): worker 0 waits for a message worker 1 never sends and prints
``TIMEOUT <the error>``.

usage: tls_point_to_point.py OUT_DIR mesh|missing
"""

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import phalanx

out_dir, mode = Path(sys.argv[1]), sys.argv[2]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank, world = dist.get_rank(), dist.get_world_size()
result = {"uses_tls": strategy._group.uses_tls}

if mode == "missing":
    if rank == 0:
        try:
            dist.irecv(torch.zeros(1), src=1, tag=9).wait(timedelta(seconds=4))
            print("RECEIVED", flush=True)
        except RuntimeError as exc:
            print(f"TIMEOUT {type(exc).__name__}: {exc}", flush=True)
    else:
        time.sleep(8)  # alive, sending heartbeats, and never sending
    sys.exit(0)

# ---------------------------------------------------------------- send/recv, tags, any source
if rank in (0, 1):
    peer = rank + 2  # the ring is 0 -> 1 -> 2 -> 3: two hops away
    if rank == 0:
        for tag in (1, 2, 3):
            dist.send(torch.full((3,), float(tag)), dst=peer, tag=tag)
    else:
        works = [dist.isend(torch.full((3,), 10.0 + tag), dst=peer, tag=tag) for tag in (1, 2, 3)]
        for work in works:
            work.wait()
    back = torch.zeros(2)
    dist.recv(back, src=peer, tag=7)
    result["reply"] = back.tolist()
else:
    got = {}
    for tag in (3, 1, 2):  # not in the order they were sent
        into = torch.zeros(3)
        if rank == 2:
            dist.recv(into, src=rank - 2, tag=tag)
        else:
            dist.irecv(into, src=rank - 2, tag=tag).wait()
        got[tag] = into.tolist()
    result["tags"] = got
    dist.send(torch.tensor([float(rank), -1.0]), dst=rank - 2, tag=7)
if rank == 0:
    into = torch.zeros(1)
    result["any_source"] = [dist.recv(into, tag=5), into.item()]
elif rank == 3:
    dist.send(torch.tensor([33.0]), dst=0, tag=5)
received = torch.zeros(2)
ops = [
    dist.P2POp(dist.isend, torch.tensor([float(rank), 100.0 + rank]), (rank + 2) % world),
    dist.P2POp(dist.irecv, received, (rank - 2) % world),
]
for work in dist.batch_isend_irecv(ops):
    work.wait()
result["batch"] = received.tolist()

# ---------------------------------------------------------------- subgroups
pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every worker makes every group
mine = pairs[rank % 2]
total = torch.tensor([rank + 1.0])
dist.all_reduce(total, group=mine)
gathered = [torch.zeros(1) for _ in range(2)]
dist.all_gather(gathered, torch.tensor([float(rank)]), group=mine)
result["pairs"] = [total.item(), [g.item() for g in gathered]]
trio = dist.new_group([0, 1, 2])
if rank < 3:
    summed = torch.full((5,), rank + 1.0)
    dist.all_reduce(summed, group=trio)
    sent = torch.tensor([float(rank), 0.0])
    dist.broadcast(sent, src=2, group=trio)
    result["trio"] = [summed.tolist(), sent.tolist()]
    if rank == 0:  # point-to-point on a group: its ranks, messages apart from the job's group's
        dist.send(torch.tensor([8.0]), group=trio, group_dst=2, tag=7)
    elif rank == 2:
        into = torch.zeros(1)
        dist.recv(into, group=trio, group_src=0, tag=7)
        result["trio_p2p"] = into.item()
single = dist.new_group([rank], use_local_synchronization=True)  # a group of one: no network
lone = torch.tensor([4.0])
dist.all_reduce(lone, group=single)
result["single"] = lone.item()

# ---------------------------------------------------------------- a 2-D DeviceMesh
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
for axis in ("pp", "dp"):
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value, group=mesh.get_group(axis))
    result[f"mesh_{axis}"] = value.item()

# ---------------------------------------------------------------- a 2-stage pipeline along pp
stage, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
pp, dp = mesh.get_group("pp"), mesh.get_group("dp")


def whole_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(index):
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + index))


model = whole_model()
part = model[:2] if stage == 0 else model[2:]
if stage == 0:
    hidden = part(batch(replica))
    dist.send(hidden.detach(), group=pp, group_dst=1, tag=11)  # activations forward
    grad = torch.empty_like(hidden)
    dist.recv(grad, group=pp, group_src=1, tag=12)  # their gradient back
    hidden.backward(grad)
    loss = None
else:
    hidden = torch.empty(6, 16)
    dist.recv(hidden, group=pp, group_src=0, tag=11)
    hidden.requires_grad_(True)
    loss = part(hidden).square().mean()
    loss.backward()
    dist.send(hidden.grad, group=pp, group_dst=0, tag=12)
grads = []
for parameter in part.parameters():
    dist.all_reduce(parameter.grad, group=dp)  # the data-parallel average, along dp
    grads.append((parameter.grad / 2).reshape(-1).tolist())
reference = whole_model()  # the same step in one process: both replicas' batches
torch.stack([reference(batch(i)).square().mean() for i in range(2)]).mean().backward()
ref_part = reference[:2] if stage == 0 else reference[2:]
result["pipeline"] = {
    "stage": stage,
    "grads": grads,
    "reference": [p.grad.reshape(-1).tolist() for p in ref_part.parameters()],
    "loss": None if loss is None else loss.item(),
    "reference_loss": reference(batch(replica)).square().mean().item(),
}
dist.barrier()
(out_dir / f"p2p-{rank}.json").write_text(json.dumps(result))
strategy.close()
