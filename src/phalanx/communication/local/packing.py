"""Packing many small tensors into few flat buffers, and back (TF's batch_reduce packing)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackSpec", "pack", "split_packs", "unpack"]


@dataclass(frozen=True)
class PackSpec:
    """Where each tensor lives in the flat buffers: per tensor (dtype, offset, shape)."""

    slots: tuple[tuple[torch.dtype, int, torch.Size], ...]
    dtypes: tuple[torch.dtype, ...]


def pack(tensors: list[torch.Tensor | None], like: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """Concatenates tensors into one flat buffer per dtype; None counts as zeros shaped ``like``.

    Args:
        tensors: The tensors, any shapes (same device).
        like: One tensor per entry giving shape, dtype and device for a None entry.

    Returns:
        dtype -> 1-D buffer, in first-seen dtype order.
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t, ref in zip(tensors, like, strict=True):
        if t is None:
            t = torch.zeros_like(ref, memory_format=torch.contiguous_format)
        groups.setdefault(t.dtype, []).append(t.reshape(-1))
    return {
        dtype: torch.cat(parts) if len(parts) > 1 else parts[0].clone() for dtype, parts in groups.items()
    }


def spec_of(like: list[torch.Tensor]) -> PackSpec:
    """The layout `pack` gives to tensors shaped like ``like``."""
    offsets: dict[torch.dtype, int] = {}
    slots = []
    for t in like:
        offset = offsets.get(t.dtype, 0)
        slots.append((t.dtype, offset, t.shape))
        offsets[t.dtype] = offset + t.numel()
    return PackSpec(tuple(slots), tuple(offsets))


def unpack(buffers: dict[torch.dtype, torch.Tensor], spec: PackSpec) -> list[torch.Tensor]:
    """Views into ``buffers`` shaped as the packed tensors were."""
    out = []
    for dtype, offset, shape in spec.slots:
        numel = shape.numel()
        out.append(buffers[dtype][offset : offset + numel].view(shape))
    return out


def split_packs(buffer: torch.Tensor, num_packs: int) -> list[torch.Tensor]:
    """Splits a flat buffer into ``num_packs`` nearly equal contiguous chunks (views)."""
    if num_packs <= 1 or buffer.numel() < num_packs:
        return [buffer]
    return list(torch.tensor_split(buffer, num_packs))
