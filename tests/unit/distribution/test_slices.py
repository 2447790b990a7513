"""Where a worker's part sits in the full tensor, walked in row blocks and byte runs."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.distribution.slices import Region, byte_runs, region_of, row_blocks, writes_region

BOXES = [  # (shape, offsets, sizes)
    ((10, 4), (3, 0), (5, 4)),  # whole rows: one run
    ((10, 4), (0, 1), (10, 2)),  # a column band: one run per row
    ((6, 5, 4), (2, 1, 0), (3, 2, 4)),  # cut in dims 0 and 1, dim 2 whole
    ((6, 5, 4), (1, 0, 1), (2, 5, 3)),  # cut in the last dim only
    ((7,), (2,), (4,)),
    ((3, 3), (0, 0), (3, 3)),  # the whole tensor
    ((), (), ()),  # a 0-d tensor
    ((4, 4), (4, 0), (0, 4)),  # an empty part (more workers than rows)
]


@pytest.mark.parametrize(("shape", "offsets", "sizes"), BOXES)
def test_byte_runs_cover_exactly_the_box_in_row_major_order(shape, offsets, sizes):
    full = torch.arange(math.prod(shape)).reshape(shape)
    region = Region(shape, offsets, sizes)
    part = full[region.slices()].reshape(-1)
    flat = full.reshape(-1)
    covered = 0
    for at, offset, length in byte_runs(region):
        torch.testing.assert_close(flat[at : at + length], part[offset : offset + length])
        covered += length
    assert covered == part.numel()


def test_the_rows_of_a_box_are_its_first_dimension():
    region = Region((10, 4), (3, 0), (5, 4))
    assert region.slices((1, 3)) == (slice(4, 6), slice(0, 4))


def test_row_blocks_bound_each_read_and_cover_every_row():
    region = Region((1000, 256), (100, 0), (300, 256))  # rows of 1 KiB in float32
    blocks = list(row_blocks(region, 4, limit=10 * 1024))
    assert blocks[0] == (0, 10)
    assert all(stop - start <= 10 for start, stop in blocks)
    assert [r for start, stop in blocks for r in range(start, stop)] == list(range(300))
    assert list(row_blocks(Region((5, 1 << 20), (0, 0), (5, 1 << 20)), 4, limit=16)) == [
        (i, i + 1) for i in range(5)
    ]  # a row bigger than the limit: one row at a time
    assert list(row_blocks(Region((), (), ()), 4)) == [(0, 1)]


def test_a_plain_tensor_is_whole_and_written_by_the_chief_alone():
    tensor = torch.zeros(3, 2)
    assert region_of(tensor) == Region((3, 2), (0, 0), (3, 2))
    assert writes_region(tensor, rank=0)
    assert not writes_region(tensor, rank=1)
