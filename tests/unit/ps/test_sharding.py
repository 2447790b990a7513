"""A sharded table's row reads and row gradients, cut per shard: a lookup's sorted rows take
slices, any other rows masks, and both give the same requests and gradients."""

from __future__ import annotations

import pytest
import torch

from phalanx.ps import sharding
from phalanx.ps.handles import VariableHandle
from phalanx.ps.variables import _gather_rows, _row_requests

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def _table(rows_per_shard: list[int], width: int = 3) -> VariableHandle:
    shards = tuple(
        VariableHandle(f"t/part_{i}", ps=i % 2, shape=(n, width), dtype="float32")
        for i, n in enumerate(rows_per_shard)
    )
    return VariableHandle("t", ps=0, shape=(sum(rows_per_shard), width), dtype="float32", shards=shards)


def _by_mask(table: VariableHandle, rows: torch.Tensor) -> dict[int, list[tuple[str, list[int], list[int]]]]:
    """What each ps task is asked, worked out row by row."""
    asks: dict[int, list[tuple[str, list[int], list[int]]]] = {}
    for shard, (start, stop) in zip(table.shards, sharding.rows_of(table), strict=True):
        mine = [i for i, r in enumerate(rows.tolist()) if start <= r < stop]
        if mine:
            asks.setdefault(shard.ps, []).append((shard.name, [rows[i].item() - start for i in mine], mine))
    return asks


def _as_lists(asks):  # noqa: ANN001, ANN202
    out = {}
    for ps, mine in asks.items():
        out[ps] = []
        for name, rows, where in mine:
            positions = list(range(where.start, where.stop)) if isinstance(where, slice) else where.tolist()
            out[ps].append((name, rows.tolist(), positions))
    return out


@pytest.mark.parametrize(
    "rows",
    [[0, 3, 4, 9, 10, 19], [5, 6], [12, 15], [2, 2, 11], [9, 0, 14, 3], [7]],
    ids=["sorted", "one shard", "last shard", "repeated", "unsorted", "one row"],
)
def test_row_requests_by_slices_and_by_masks_agree(rows):
    table = _table([10, 5, 5])
    rows = torch.tensor(rows)
    asks = _row_requests(table, rows)
    assert _as_lists(asks) == _by_mask(table, rows)
    # each ps task answers a row with its number inside the shard
    replies = {ps: ({}, [r.float()[:, None].expand(-1, 3) for _, r, _ in mine]) for ps, mine in asks.items()}
    bounds = sharding.rows_of(table)
    local = [next(r - start for start, stop in bounds if start <= r < stop) for r in rows.tolist()]
    assert _gather_rows(table, rows, asks, replies)[:, 0].tolist() == [float(r) for r in local]


@pytest.mark.parametrize("rows", [[0, 3, 9, 10, 14, 15, 19], [1], [16, 18]])
def test_a_coalesced_row_gradient_splits_by_slices_as_by_masks(rows):
    table = _table([10, 5, 5])
    indices = torch.tensor([rows])
    values = torch.arange(len(rows) * 3, dtype=torch.float32).reshape(-1, 3)
    grad = torch.sparse_coo_tensor(indices, values, table.shape).coalesce()
    parts = sharding.split_gradient(table, grad)
    for part, (start, stop) in zip(parts, sharding.rows_of(table), strict=True):
        mine = [i for i, r in enumerate(rows) if start <= r < stop]
        assert part.shape == (stop - start, 3)
        assert part.is_coalesced()
        assert part.indices().tolist() == [[rows[i] - start for i in mine]]
        assert torch.equal(part.values(), values[mine])
