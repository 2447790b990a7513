"""Where this worker's part of a tensor sits in the full tensor, and how to walk it.

A sharded parameter (a DTensor) holds one region of the full tensor on each worker: an offset
and a size in every dimension, as ``torch.distributed.checkpoint`` reads them
(``DTensor.__create_chunk_list__``). Loading and saving weights file by file works on that
region only: `local_part` cuts it out of a full tensor that is only mapped (``torch.load(...,
mmap=True)``) without reading the rest, `row_blocks` splits it into blocks of rows of bounded
size (a shard bigger than what a worker can hold twice is read a block at a time), and
`byte_runs` gives the contiguous runs of bytes it covers in a row-major file.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = ["BLOCK_BYTES", "Region", "byte_runs", "local_part", "region_of", "row_blocks", "writes_region"]

BLOCK_BYTES = 64 << 20  # the most a read or a write holds besides the tensors themselves


@dataclass(frozen=True)
class Region:
    """A box of a tensor of ``shape``: ``sizes[d]`` elements from ``offsets[d]`` in each dimension."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def slices(self, rows: tuple[int, int] | None = None) -> tuple[slice, ...]:
        """The region as slices of the full tensor (``rows``: only local rows ``[start, stop)``)."""
        cuts = [slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True)]
        if rows is not None and cuts:
            cuts[0] = slice(self.offsets[0] + rows[0], self.offsets[0] + rows[1])
        return tuple(cuts)


def region_of(tensor: torch.Tensor) -> Region:
    """The region of the full tensor that ``tensor`` holds here: a DTensor's local shard, or
    all of a plain tensor.

    Raises:
        ValueError: The DTensor's local part is not one box of the full tensor (DCP's
            chunk list has several entries): read it with a DCP checkpoint instead.
    """
    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return Region(shape, (0,) * len(shape), shape)
    chunks = tensor.__create_chunk_list__()  # DCP's description of the local shard
    if len(chunks) != 1:
        raise ValueError(
            "Weights files are read and written one box of each tensor per worker; this "
            f"parameter's local part is {len(chunks)} boxes (placements {tensor.placements}). "
            "HINT: save and restore this model with a sharded (DCP) checkpoint: "
            "phalanx.checkpoint.Checkpoint(...).write(path, sharded=True)."
        )
    return Region(shape, tuple(int(o) for o in chunks[0].offsets), tuple(int(s) for s in chunks[0].sizes))


def writes_region(tensor: torch.Tensor, rank: int) -> bool:
    """Whether this worker writes its region of ``tensor`` to a file: one holder of each
    region writes it (the first along every mesh dimension the tensor is replicated on; the
    chief, rank 0, for a plain tensor, which every worker holds whole)."""
    if not isinstance(tensor, DTensor):
        return rank == 0
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this worker is not in the tensor's mesh
        return False
    return all(c == 0 for c, p in zip(coordinate, tensor.placements, strict=True) if isinstance(p, Replicate))


def local_part(full: torch.Tensor, like: DTensor) -> DTensor:
    """This worker's part of ``full`` as a DTensor laid out as ``like`` (same shape).

    ``full`` is only cut (a view): if it maps a file (``torch.load(path, mmap=True)``) no byte
    outside this worker's region is read, now or when the result is copied into ``like``.
    Only that part is converted to ``like``'s device and dtype. A layout other than plain
    ``Shard`` / ``Replicate`` placements (FSDP2 over tensor parallelism's strided shards) is cut
    by torch's ``distribute_tensor`` from the whole tensor instead.
    """
    if any(type(p) not in (Shard, Replicate) for p in like.placements):  # strided (2-D) layouts
        whole = full.detach().to(device=like.device, dtype=like.dtype)  # torch's own cut: reads all
        return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
    region = region_of(like)
    part = full.detach()[region.slices()].to(device=like.device, dtype=like.dtype)
    return DTensor.from_local(
        part, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def row_blocks(region: Region, itemsize: int, limit: int | None = None) -> Iterator[tuple[int, int]]:
    """Local rows ``[start, stop)`` of ``region`` in blocks of at most ``limit`` bytes
    (default `BLOCK_BYTES`; at least one row each); a 0-d tensor is one block ``(0, 1)``."""
    limit = BLOCK_BYTES if limit is None else limit
    if not region.sizes:
        yield 0, 1
        return
    rows = region.sizes[0]
    row_bytes = max(1, math.prod(region.sizes[1:]) * itemsize)
    step = max(1, limit // row_bytes)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def byte_runs(region: Region) -> Iterator[tuple[int, int, int]]:
    """The contiguous runs that ``region`` covers in its row-major full tensor, as
    ``(start in the full tensor, start in the region, length)``, in elements.

    The dimensions after the last one the region cuts are whole, so each run spans them; one
    run per index of the dimensions before it (one run for a box of whole rows).
    """
    shape, offsets, sizes = region.shape, region.offsets, region.sizes
    if region.numel == 0:
        return
    cut = max((d for d in range(len(shape)) if sizes[d] != shape[d]), default=-1)
    if cut < 0:
        yield 0, 0, math.prod(shape)
        return
    inner = math.prod(shape[cut + 1 :])
    length = sizes[cut] * inner
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    outer = sizes[:cut]
    for index, position in enumerate(_positions(outer)):
        start = sum((offsets[d] + position[d]) * strides[d] for d in range(cut)) + offsets[cut] * inner
        yield start, index * length, length


def _positions(sizes: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every index into a box of ``sizes``, in row-major order (one empty index for none)."""
    if not sizes:
        yield ()
        return
    for first in range(sizes[0]):
        for rest in _positions(sizes[1:]):
            yield (first, *rest)
