"""All-reduces through the shared-memory transport (or the TLS ring, with
PHALANX_COLLECTIVES=tls and PHALANX_SHARED_MEMORY=0), checked against gloo on the same workers.

Writes ``shm-<rank>.json`` to OUT_DIR: whether the transport was used, every case's agreement
with gloo (bit for bit, or close where gloo sums in another order) and across workers, and the
files of this job left in /dev/shm and the gloo threads left after close().

usage: shared_memory_checks.py OUT_DIR
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx
from phalanx.communication.transports.shm.shared_memory import CHUNK_ELEMENTS, TWO_SHOT_ELEMENTS

out_dir = sys.argv[1]
strategy = phalanx.MultiWorkerMirroredStrategy()
group = strategy._group
rank = strategy.cluster_resolver.worker_index
result = {"uses_shared_memory": group.uses_shared_memory, "uses_tls": group.uses_tls, "cases": {}}

cases = [
    ("float32", 1, "sum"),
    ("float32", 1000, "sum"),
    ("float32", 5001, "sum"),  # not a power of two: a part of a larger slot
    ("float32", CHUNK_ELEMENTS + 3, "sum"),  # two chunks
    ("float32", TWO_SHOT_ELEMENTS + 7, "sum"),  # two-shot with 3 or more workers
    ("float64", TWO_SHOT_ELEMENTS, "max"),
    ("float64", 777, "sum"),
    ("bfloat16", 300, "sum"),
    ("int64", 64, "sum"),
    ("float32", 513, "max"),
    ("float32", 513, "min"),
    ("float32", 1000, "sum"),  # a size seen before: its segment is reused
]
ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
for i, (dtype_name, numel, op) in enumerate(cases):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(1000 * i + rank)  # different on every worker
    if dtype.is_floating_point:
        value = torch.randn(numel, generator=g).to(dtype)
    else:
        value = torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
    ours, reference = value.clone(), value.clone()
    inputs = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(inputs, value)
    combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    in_rank_order = inputs[0].clone()
    for other in inputs[1:]:  # what the transport promises, one-shot or two-shot: rank order
        in_rank_order = combine(in_rank_order, other)
    group.all_reduce(ours, ops[op])  # the transport
    dist.all_reduce(reference, ops[op])  # gloo directly
    tol = 0.05 if dtype == torch.bfloat16 else 1e-5  # gloo may sum 3 workers in another order
    copies = [torch.empty_like(ours) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, ours)
    result["cases"][f"{i}-{dtype_name}-{numel}-{op}"] = {
        "equal": bool(torch.equal(ours, reference)),
        "rank_order": bool(torch.equal(ours, in_rank_order)),
        "close": bool(torch.allclose(ours.double(), reference.double(), rtol=tol, atol=tol)),
        "same_on_every_worker": all(torch.equal(c, ours) for c in copies),
    }

# all-gather, broadcast and reduce-scatter: every worker regenerates every peer's input, so
# each result is compared exactly with what it must be (copies, and sums in rank order)
world = dist.get_world_size()


def _values(case: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [
        torch.randn(numel, generator=torch.Generator().manual_seed(7919 * case + r)).to(dtype)
        for r in range(world)
    ]


result["moves"] = {}
for i, (dtype, numel) in enumerate(
    [(torch.float32, 1), (torch.float32, 5001), (torch.bfloat16, 300), (torch.float32, CHUNK_ELEMENTS + 3)]
):
    values = _values(i, numel, dtype)
    gathered = group.all_gather(values[rank].clone())
    into = torch.empty(numel * world, dtype=dtype)
    dist.all_gather_into_tensor(into, values[rank].clone())  # the default group: phalanx's
    sent = values[rank].clone()
    group.broadcast(sent, src=world - 1)
    parts = _values(100 + i, numel * world, dtype)  # worker r's input: world parts of numel
    mine = torch.empty(numel, dtype=dtype)
    dist.reduce_scatter_tensor(mine, parts[rank].clone())  # the default group: phalanx's
    expected = parts[0][rank * numel : (rank + 1) * numel].clone()
    for other in parts[1:]:
        expected = expected + other[rank * numel : (rank + 1) * numel]
    averaged = torch.empty(numel, dtype=dtype)
    dist.reduce_scatter_tensor(averaged, parts[rank].clone(), op=dist.ReduceOp.AVG)
    result["moves"][f"{i}-{dtype}-{numel}"] = {
        "all_gather": all(torch.equal(g, v) for g, v in zip(gathered, values, strict=True)),
        "all_gather_into_tensor": bool(torch.equal(into, torch.cat(values))),
        "broadcast": bool(torch.equal(sent, values[world - 1])),
        "reduce_scatter": bool(torch.equal(mine, expected)),
        "reduce_scatter_avg": bool(torch.allclose(averaged.double(), (expected / world).double(), atol=0.02)),
    }

# an async all-reduce overlapping a gloo collective of the training thread
pending = torch.full((4096,), float(rank + 1))
work = group.all_reduce_async(pending)
flag = torch.tensor([rank], dtype=torch.int64)
group.all_reduce(flag, dist.ReduceOp.MAX, what="a small collective meanwhile")
group.wait(work, "the overlapped all-reduce")
del work  # a gloo work that outlives its process group aborts the interpreter at exit
result["overlapped"] = pending[0].item()
result["reduce_sum"] = strategy.reduce("sum", torch.tensor([rank + 1.0]), axis=None).item()
result["broadcast"] = group.broadcast(torch.full((3,), float(rank)), src=1).tolist()
result["all_gather"] = [int(t) for t in group.all_gather(torch.tensor([rank * 10]))]

token = group._shm._token if group._shm is not None else None
strategy.close()
result["left_in_dev_shm"] = sorted(f for f in os.listdir("/dev/shm") if token and token in f)
# close() tore the process groups down: no gloo thread is left to free a tensor (it would
# need the GIL) while the interpreter finalizes
names = []
for tid in os.listdir("/proc/self/task"):
    with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
        names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
result["gloo_threads_after_close"] = sorted(n for n in names if "gloo" in n)
with open(os.path.join(out_dir, f"shm-{rank}.json"), "w") as f:
    json.dump(result, f)
