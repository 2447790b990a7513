"""Sparse gradients (``nn.Embedding(sparse=True)``) on the packed gradient path and in buckets.

Sparse gradients cannot travel in the packed dense buffers. Each replica says per gradient
what it has (`kind`: none, dense or sparse); the kinds are summed over the replicas and
across workers, so every worker agrees on which gradients nobody has (they stay None) and
which are sparse somewhere. Those are summed apart: over the local replicas, then across
workers by gathering every worker's indices and values (`Strategy.cross_worker_sparse_sum`),
in gradient order on every worker. Their slot in the packed buffers carries zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["SPARSE", "empty_sparse", "kind", "plus", "sum_sparse"]

SPARSE = 1024.0  # a sparse gradient's kind; the dense ones (1.0 each) never add up to it


def kind(grad: torch.Tensor | None) -> float:
    """0: no gradient, 1: dense, `SPARSE`: sparse."""
    if grad is None:
        return 0.0
    return SPARSE if grad.is_sparse else 1.0


def empty_sparse(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A sparse COO tensor of ``shape`` with no entries (one sparse dimension, as an
    embedding's gradient has)."""
    indices = torch.empty((1, 0), dtype=torch.int64, device=device)
    values = torch.empty((0, *shape[1:]), dtype=dtype, device=device)
    return torch.sparse_coo_tensor(indices, values, shape)


def sum_sparse(
    grads: Sequence[torch.Tensor | None],
    like: torch.Tensor,
    home: torch.device,
    cross_worker: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The sum of the local replicas' sparse ``grads`` (None: none), then across workers
    (every worker calls it for the same gradients, in the same order; it blocks)."""
    total = empty_sparse(like.shape, like.dtype, home)
    for g in grads:
        if g is not None:
            total = total + (g if g.is_sparse else g.to_sparse()).to(home)
    return cross_worker(total.coalesce()).coalesce()


def plus(base: torch.Tensor | None, total: torch.Tensor) -> torch.Tensor:
    """``base + total`` as the new gradient (in place into a dense base)."""
    if base is None:
        return total
    if base.layout == torch.strided:
        return base.add_(total)
    return base + total
