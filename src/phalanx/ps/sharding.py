"""A variable split along its first axis over several ps tasks: how its values, gradients and
optimizer state are cut into shards and put back together (used by `PSClient`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from phalanx.ps.handles import VariableHandle

__all__ = ["join_state", "join_values", "rows_of", "split_gradient", "split_state", "split_value"]


def rows_of(handle: VariableHandle) -> list[tuple[int, int]]:
    """``(start, stop)`` rows of each of ``handle``'s shards."""
    out, start = [], 0
    for shard in handle.shards:
        out.append((start, start + shard.shape[0]))
        start += shard.shape[0]
    return out


def split_value(handle: VariableHandle, value: torch.Tensor) -> list[torch.Tensor]:
    """The rows of each shard (views)."""
    return [value[start:stop] for start, stop in rows_of(handle)]


def join_values(handle: VariableHandle, values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole variable from its shards' values."""
    return torch.cat(list(values), dim=0)


def split_gradient(handle: VariableHandle, grad: torch.Tensor) -> list[torch.Tensor]:
    """Each shard's gradient: its rows of a dense one, its entries of a sparse (COO) one."""
    if not grad.is_sparse:
        return split_value(handle, grad)
    grad = grad.coalesce()
    indices, values = grad.indices(), grad.values()
    bounds = rows_of(handle)
    if indices.shape[0] == 1:  # rows sorted and distinct: each shard's entries are one slice
        cuts = torch.searchsorted(indices[0], torch.tensor([stop for _, stop in bounds[:-1]])).tolist()
        ends = [*cuts, indices.shape[1]]
        return [
            torch.sparse_coo_tensor(
                indices[:, lo:hi] - start,
                values[lo:hi],
                (stop - start, *grad.shape[1:]),
                check_invariants=False,
                is_coalesced=True,
            )
            for (start, stop), lo, hi in zip(bounds, [0, *cuts], ends, strict=True)
        ]
    out = []
    for start, stop in bounds:
        keep = (indices[0] >= start) & (indices[0] < stop)
        shifted = indices[:, keep].clone()
        shifted[0] -= start
        size = (stop - start, *grad.shape[1:])
        out.append(torch.sparse_coo_tensor(shifted, values[keep], size, check_invariants=False))
    return out


def join_state(handle: VariableHandle, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer state from the shards' states: per-row tensors are concatenated, the rest
    (a step count) is taken from the first shard."""
    states = [s for s in states if s]
    if not states:
        return {}
    out: dict[str, Any] = {}
    first_rows = handle.shards[0].shape[0]
    for key, value in states[0].items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == first_rows:
            out[key] = torch.cat([s[key] for s in states], dim=0)
        else:
            out[key] = value
    return out


def split_state(handle: VariableHandle, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Each shard's optimizer state from the whole variable's (see `join_state`)."""
    rows = handle.shape[0]
    out: list[dict[str, Any]] = [{} for _ in handle.shards]
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
            for i, part in enumerate(split_value(handle, value)):
                out[i][key] = part.clone()
        else:
            for entry in out:
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out
