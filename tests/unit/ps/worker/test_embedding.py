"""A worker's sparse gradient of a table from the rows its lookups read."""

from __future__ import annotations

import torch

from phalanx.ps.worker.embedding import sparse_gradient


def _looked_up(rows: list[int], grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.zeros(len(rows), grads.shape[1], requires_grad=True)
    values.grad = grads
    return torch.tensor(rows), values


def test_one_lookup_is_its_rows_as_they_are():
    """torch.unique's rows are sorted and distinct: the gradient is coalesced as built."""
    grads = torch.arange(6.0).reshape(3, 2)
    grad = sparse_gradient((10, 2), [_looked_up([1, 4, 7], grads)])
    assert grad is not None
    assert grad.is_coalesced()
    assert torch.equal(grad.indices(), torch.tensor([[1, 4, 7]]))
    assert torch.equal(grad.values(), grads)


def test_two_lookups_of_one_row_add_up():
    first, second = torch.ones(2, 2), torch.full((2, 2), 2.0)
    grad = sparse_gradient((10, 2), [_looked_up([3, 5], first), _looked_up([0, 3], second)])
    assert grad is not None
    assert grad.is_coalesced()
    assert torch.equal(grad.indices(), torch.tensor([[0, 3, 5]]))
    assert torch.equal(grad.values(), torch.tensor([[2.0, 2.0], [3.0, 3.0], [1.0, 1.0]]))


def test_no_gradient_without_a_looked_up_row_that_got_one():
    rows, values = torch.tensor([1]), torch.zeros(1, 2)
    assert sparse_gradient((10, 2), [(rows, values)]) is None
