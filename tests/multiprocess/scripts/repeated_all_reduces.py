"""Repeated all-reduces over gloo (`phalanx.communication.transports.gloo.repeats`): once predicted, one
gloo call each (staged with the codes) or two back to back (large: the codes beside it), and
a prediction broken by every worker alike, or by one worker only.

Writes ``repeats-<rank>.json`` to OUT_DIR. Mode ``alike``: the sums of every call, the gloo calls
each repeat made, and the sums after breaks every worker makes. Mode ``stray``: worker 1 breaks
a prediction on its own; each worker records the error it raised and its tensor afterwards.

usage: repeated_all_reduces.py OUT_DIR MODE
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError

out_dir, mode = Path(sys.argv[1]), sys.argv[2]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = dist.get_rank()
transport = strategy._group._gloo


class Counting:
    """The transport's gloo group, recording the element count of each all-reduce."""

    def __init__(self, group):
        self.group, self.calls = group, []

    def allreduce(self, tensors, options):
        self.calls.append(tensors[0].numel())
        return self.group.allreduce(tensors, options)

    def __getattr__(self, name):
        return getattr(self.group, name)


counting = Counting(transport.group)
transport.group = counting
result: dict = {}


def repeat(numel: int, times: int, op=dist.ReduceOp.SUM, dtype=torch.float32) -> tuple[list, list]:
    """``times`` all-reduces of the same size: the first element of each sum, and the gloo
    calls of each (their element counts)."""
    sums, calls = [], []
    for i in range(times):
        x = torch.full((numel,), float(rank + 1 + i), dtype=dtype)
        before = len(counting.calls)
        dist.all_reduce(x, op=op)
        calls.append(counting.calls[before:])
        assert bool((x == x[0]).all()), "every element of the sum alike"
        sums.append(x[0].item())
    return sums, calls


if mode == "alike":
    result["staged"] = repeat(1 << 16, 5)  # 256 KiB: one call once predicted
    result["pipelined"] = repeat(1 << 18, 5)  # 1 MiB: the codes beside the tensor, after 4
    result["max_int"] = repeat(1 << 16, 8, dist.ReduceOp.MAX, torch.int64)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)  # breaks the prediction on every worker: it goes on
    result["broadcast"] = b.item()
    result["after_break"] = repeat(1 << 16, 8)  # predicted again only after the skip
    small = torch.full((3,), float(rank + 1))
    dist.all_reduce(small)  # another size
    result["small"] = small.tolist()
else:
    repeat(1 << 16, 4)  # predicted from the third
    x = torch.full((1 << 16,), float(rank + 1))
    try:
        if rank == 1:
            dist.all_reduce(torch.ones(5))  # only worker 1: breaks the prediction on its own
        dist.all_reduce(x)
    except CollectiveMismatchError as exc:
        result["error"] = str(exc)
    result["tensor"] = x[0].item()
(out_dir / f"repeats-{rank}.json").write_text(json.dumps(result))
if mode == "alike":
    strategy.close()
