"""The sum of a sparse COO tensor over the workers of a phalanx process group
(``torch.distributed.all_reduce`` of a sparse tensor, as gloo does it).

Each worker's entries are gathered (their number first, then the indices and values padded to
the largest number), laid side by side and coalesced: the result is the sparse sum, written
into the tensor in place. Only SUM, one tensor at a time (gloo's rule).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.communication.group.pg_work import Engine, Work

__all__ = ["check_sparse", "sparse_all_reduce"]


def check_sparse(tensors: list[torch.Tensor], op: Any, what: str) -> bool:
    """Whether ``tensors`` take the sparse path (one sparse tensor, SUM, all_reduce).

    Raises:
        ValueError: A sparse tensor in another collective, beside other tensors, or with
            another op than SUM.
    """
    if not any(t.is_sparse for t in tensors):
        return False
    if what != "all_reduce" or len(tensors) != 1 or op != dist.ReduceOp.SUM:
        raise ValueError(
            "The phalanx process group sums a sparse tensor with all_reduce, one tensor at a time, "
            f"with ReduceOp.SUM. Received: {what} of {len(tensors)} tensor(s), op {op}. HINT: call "
            "all_reduce(tensor) per sparse tensor, or densify it with tensor.to_dense()."
        )
    return True


def sparse_all_reduce(engine: Engine, tensor: torch.Tensor) -> Work:
    """Sums the sparse ``tensor`` over every worker, in place (all workers; same shape and
    dtype everywhere). Blocks on the gather of the entry counts; the returned work finishes
    when the entries arrived and the sum was written."""
    local = tensor.coalesce()
    indices, values = local.indices(), local.values()  # (sparse_dim, nnz), (nnz, *dense)
    counts_work, counts = engine.all_gather_async(torch.tensor([indices.shape[1]]))
    engine.wait(counts_work, "all_reduce (sparse: entry counts)")
    sizes = [int(c.item()) for c in counts]
    most = max(sizes)
    padded_indices = torch.zeros((indices.shape[0], most), dtype=torch.int64)
    padded_indices[:, : indices.shape[1]] = indices
    padded_values = torch.zeros((most, *values.shape[1:]), dtype=values.dtype)
    padded_values[: values.shape[0]] = values
    # one all-gather of both: the indices as the values' dtype would lose precision, so bytes
    payload = torch.cat(
        [padded_indices.reshape(-1).view(torch.uint8), padded_values.reshape(-1).view(torch.uint8)]
    )
    inner, parts = engine.all_gather_async(payload)
    index_bytes = padded_indices.numel() * 8

    def finish() -> list[torch.Tensor]:
        all_indices, all_values = [], []
        for size, part in zip(sizes, parts, strict=True):
            idx = part[:index_bytes].view(torch.int64).view(indices.shape[0], most)
            val = part[index_bytes:].view(values.dtype).view(most, *values.shape[1:])
            all_indices.append(idx[:, :size])
            all_values.append(val[:size])
        total = torch.sparse_coo_tensor(
            torch.cat(all_indices, dim=1), torch.cat(all_values), tensor.shape, dtype=tensor.dtype
        ).coalesce()
        tensor.copy_(total)
        return [tensor]

    return Work(engine, inner, "all_reduce", finish)
