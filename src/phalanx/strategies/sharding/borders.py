"""Where DTensors meet plain tensors under ModelParallelStrategy, and its batch-axis gather.

A replicated block (`phalanx.strategies.sharding.tensor_plan.replicated_blocks`) holds DTensor
parameters replicated over the model axis and takes and gives plain tensors: torch's
``distribute_module`` calls `keep_parameters`, `replicated_inputs` and `local_outputs` at its
border. `whole` turns what a step returns under loss parallel into plain tensors;
`gather_padded` concatenates the replicas' values over the batch axis's process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["gather_padded", "keep_parameters", "local_outputs", "replicated_inputs", "whole"]


def keep_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """``distribute_module``'s partition step: nothing (the parameters are DTensors already)."""


def replicated_inputs(module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
    """A replicated block's plain tensor inputs as DTensors replicated over the model axis."""
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def local_outputs(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    """A replicated block's DTensor outputs as plain tensors (the same on every worker of the axis)."""
    if isinstance(outputs, DTensor):
        return outputs.to_local()
    if isinstance(outputs, tuple | list):
        return type(outputs)(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
    return outputs


def whole(value: Any) -> Any:
    """``value`` (a nest of what a step returned) with every DTensor as its full tensor."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, tuple | list):
        return type(value)(whole(v) for v in value)
    if isinstance(value, dict):
        return {k: whole(v) for k, v in value.items()}
    return value


def gather_padded(
    tensor: torch.Tensor,
    axis: int,
    local_sizes: list[int],
    group: Any,
    stage: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, list[int]]:
    """All-gathers ``tensor`` over ``group`` along ``axis``, sizes along it may differ
    (gathers the sizes, then the tensors padded to the longest, then trims)."""
    members = dist.get_world_size(group)
    sizes = stage(torch.tensor(local_sizes, dtype=torch.int64))
    parts = [torch.empty_like(sizes) for _ in range(members)]
    dist.all_gather(parts, sizes, group=group)
    all_sizes = [int(s) for part in parts for s in part]
    per_member = [int(part.sum()) for part in parts]
    moved = stage(tensor.movedim(axis, 0))  # (rows, ...)
    padded = torch.zeros((max(per_member), *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    padded[: moved.shape[0]] = moved
    gathered = [torch.empty_like(padded) for _ in range(members)]
    dist.all_gather(gathered, padded, group=group)
    result = torch.cat([g[:n] for g, n in zip(gathered, per_member, strict=True)]).movedim(0, axis)
    return result.to(tensor.device), all_sizes
