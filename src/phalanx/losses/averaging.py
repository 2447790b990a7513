"""The distributed loss convention (tf.nn.compute_average_loss / scale_regularization_loss).

Each replica divides the *sum* of its per-example losses by the *global* batch size, and
gradients are *summed* across replicas; the result equals single-device training on the
global batch. DDP users note: DDP averages gradients instead, so a DDP loss is the local mean.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx import context

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(
    per_example_loss: Any,
    sample_weight: Any = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """Sums per-example losses and divides by the global batch size (call inside `run`).

    Args:
        per_example_loss: Shape ``[batch, ...]``; every element is summed.
        sample_weight: Optional weights, broadcast against the loss from the batch axis.
        global_batch_size: The examples of the step across all replicas. When None, the
            true global count of the step is used if the distributed input knows it (so a
            13 / 12 split of 25 examples divides by 25); otherwise TF's rule, the local batch
            size times ``num_replicas_in_sync``. This differs from TF 2.21, which always uses
            its rule and so over-counts partial batches.

    Returns:
        A scalar; 0 (still differentiable) when the batch is empty.

    Raises:
        ValueError: The loss is a scalar, or ``global_batch_size`` is not positive.
        RuntimeError: ``global_batch_size`` is None in cross-replica context.
    """
    if (
        sample_weight is None
        and type(global_batch_size) is int
        and global_batch_size > 0
        and type(per_example_loss) is torch.Tensor
        and per_example_loss.dim() > 0
    ):
        return per_example_loss.sum() / global_batch_size  # the hot path, kept lean
    loss = (
        per_example_loss if isinstance(per_example_loss, torch.Tensor) else torch.as_tensor(per_example_loss)
    )
    if loss.dim() == 0:
        raise ValueError(
            "per_example_loss must have a batch dimension (rank >= 1); received a scalar. "
            "HINT: compute the loss with reduction='none'."
        )
    if sample_weight is not None:
        weight = torch.as_tensor(sample_weight, dtype=loss.dtype, device=loss.device)
        while weight.dim() < loss.dim():
            weight = weight.unsqueeze(-1)
        loss = loss * weight
    total = loss.sum()
    if global_batch_size is None:
        global_batch_size = default_global_batch_size(loss.shape[0])
    elif (
        type(global_batch_size) is not int
        and (isinstance(global_batch_size, bool) or int(global_batch_size) != global_batch_size)
        or global_batch_size <= 0
    ):
        raise ValueError(f"global_batch_size must be a positive integer. Received: {global_batch_size!r}.")
    if global_batch_size == 0:
        return total * 0.0
    return total / global_batch_size


def default_global_batch_size(local_batch_size: int) -> int:
    """The global batch size of the running step (replica context), as `compute_average_loss` uses it.

    Raises:
        RuntimeError: Called in cross-replica context.
    """
    if context.in_cross_replica_context():
        raise RuntimeError(
            "compute_average_loss was called in cross-replica context without a "
            "global_batch_size. HINT: call it inside strategy.run, or pass global_batch_size."
        )
    ctx = context.current_replica_context()
    if ctx is not None and ctx.global_batch_size is not None:
        return ctx.global_batch_size
    return local_batch_size * _num_replicas_in_sync()


def scale_regularization_loss(regularization_loss: Any) -> torch.Tensor:
    """Divides the summed regularisation loss by ``num_replicas_in_sync`` (call inside `run`).

    Every replica adds the same regularisation term; after gradients are summed across
    replicas it counts once.
    """
    loss = torch.as_tensor(regularization_loss)
    if context.in_cross_replica_context():
        raise RuntimeError(
            "scale_regularization_loss was called in cross-replica context. HINT: call it "
            "inside strategy.run."
        )
    return loss.sum() / _num_replicas_in_sync()


def _num_replicas_in_sync() -> int:
    """The current strategy's replica count (1 outside any scope: the default strategy's)."""
    frame = context.current_frame()
    return 1 if frame is None else frame.strategy.num_replicas_in_sync
