"""A MultiWorkerMirrored program that calls torch.distributed itself, with no
init_process_group of its own: the default group is phalanx's (`phalanx.communication.group.process_group`).

Writes ``torch-<rank>.json`` to OUT_DIR: the backend torch reports, the transport used and the
results of the user's own collectives, DDP, a DCP save/load and FSDP2.

usage: torch_collectives.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import phalanx

out_dir = Path(sys.argv[1])
strategy = phalanx.MultiWorkerMirroredStrategy()
rank, world = dist.get_rank(), dist.get_world_size()
group = strategy._group
result = {"backend": dist.get_backend(), "uses_tls": group.uses_tls, "uses_shm": group.uses_shared_memory}

ring = group._transport.ring if group.uses_tls else None
carried_before = ring._count if ring is not None else 0
x = torch.full((5,), float(rank + 1))
dist.all_reduce(x)
result["all_reduce"] = x.tolist()
y = torch.tensor([rank + 1.0])
dist.all_reduce(y, op=dist.ReduceOp.MAX)
result["all_reduce_max"] = y.item()
parts = [torch.empty(2, dtype=torch.int64) for _ in range(world)]
dist.all_gather(parts, torch.tensor([rank, 10 * rank]))
result["all_gather"] = [p.tolist() for p in parts]
# all_gather_coalesced: outputs[rank][i] is worker rank's input i (torch's layout), with as
# many inputs as workers (a transposed result would look alike) and with one more
for count in (world, world + 1):
    lists = [[torch.zeros(1) for _ in range(count)] for _ in range(world)]
    dist.all_gather_coalesced(lists, [torch.tensor([10.0 * rank + i]) for i in range(count)])
    result[f"all_gather_coalesced_{count}"] = [[t.item() for t in row] for row in lists]
try:
    dist.all_gather_coalesced([[torch.zeros(1)]], [torch.zeros(1)])
except ValueError as exc:
    result["all_gather_coalesced_error"] = str(exc)
swapped = torch.empty(world)  # all_to_all: worker j gets every worker's element j
dist.all_to_all_single(swapped, torch.tensor([10.0 * rank + j for j in range(world)]))
result["all_to_all_single"] = swapped.tolist()
if group.uses_tls:  # carried by the ring's all-gathers: splits that disagree fail on every worker
    try:
        dist.all_to_all_single(torch.empty(3), torch.zeros(2), [2, 1], [1, 1])
    except ValueError as exc:
        result["all_to_all_error"] = str(exc)
everyone = dist.new_group()  # every worker: its own engine (under TLS a ring of its own)
summed = torch.tensor([rank + 1.0])
dist.all_reduce(summed, group=everyone)
result["new_group_all_reduce"] = summed.item()
if rank == 0:  # some workers (only the members build a group with local synchronisation)
    alone = torch.tensor([7.0])
    dist.all_reduce(alone, group=dist.new_group([0], use_local_synchronization=True))
    result["new_group_some"] = alone.item()
sparse = torch.sparse_coo_tensor([[rank, 2]], [1.0, 10.0 * (rank + 1)], (3,))  # entries differ per worker
dist.all_reduce(sparse)
result["sparse_all_reduce"] = sparse.to_dense().tolist()
try:
    dist.all_reduce(sparse, op=dist.ReduceOp.MAX)
except ValueError as exc:
    result["sparse_error"] = str(exc)
flat = torch.empty(2 * world)
dist.all_gather_into_tensor(flat, torch.tensor([rank + 0.5, -rank - 0.5]))
result["all_gather_into_tensor"] = flat.tolist()
mine = torch.empty(2)
dist.reduce_scatter_tensor(mine, torch.arange(2.0 * world) + rank)
result["reduce_scatter_tensor"] = mine.tolist()
b = torch.tensor([float(rank), 7.0])
dist.broadcast(b, src=world - 1)
result["broadcast"] = b.tolist()
objects = [None] * world
dist.all_gather_object(objects, {"rank": rank})
result["all_gather_object"] = objects
work = dist.all_reduce(torch.ones(3), async_op=True)
result["future"] = work.get_future().wait()[0].tolist()
dist.barrier()
result["ring_carried"] = (ring._count - carried_before) if ring is not None else 0
try:  # point-to-point: the gloo group underneath, under TLS the job's point-to-point TLS links
    if rank == 0:
        dist.send(torch.tensor([5.0]), dst=1)
        result["p2p"] = "sent"
    else:
        got = torch.zeros(1)
        dist.recv(got, src=0)
        result["p2p"] = got.tolist()
except RuntimeError as exc:
    result["p2p"] = str(exc).splitlines()[0]

torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
torch.manual_seed(1 + rank)
model(torch.randn(8, 4)).sum().backward()
result["ddp_grad"] = model.module.weight.grad.reshape(-1).tolist()

state = {"w": torch.full((4,), float(rank + 3))}
dcp.save(state, checkpoint_id=str(out_dir / "dcp"))
loaded = {"w": torch.zeros(4)}
dcp.load(loaded, checkpoint_id=str(out_dir / "dcp"))
result["dcp"] = loaded["w"].tolist()

mesh = init_device_mesh("cpu", (world,))  # FSDP2 on the same default group
torch.manual_seed(0)
sharded = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
for layer in (sharded[0], sharded[2], sharded):
    fully_shard(layer, mesh=mesh)
fsdp_optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
torch.manual_seed(1 + rank)
for _ in range(2):
    sharded(torch.randn(4, 8)).sum().backward()  # FSDP2 reduce-scatters with AVG
    fsdp_optimizer.step()
    fsdp_optimizer.zero_grad()
result["fsdp2"] = [v.full_tensor().sum().item() for v in sharded.state_dict().values()]

(out_dir / f"torch-{rank}.json").write_text(json.dumps(result))
