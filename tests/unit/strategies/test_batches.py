"""BatchLedger: what `run` learns about the batch it is given (global size, replica offsets)."""

from __future__ import annotations

import torch

from phalanx.strategies._batches import BatchLedger


def test_a_batch_is_found_by_identity_even_when_another_was_handed_out_later():
    ledger = BatchLedger()
    first, second = (torch.ones(4), torch.zeros(4)), torch.ones(2)
    ledger.remember(first, 8, [0, 4])
    ledger.remember(second, 2, None)
    assert ledger.take((first,), {}) == (8, [0, 4])
    assert ledger.take((), {"x": second}) == (2, None)
    assert ledger.take((first,), {}) == (None, None)  # each entry is taken once


def test_without_a_known_batch_run_gets_the_latest_one_handed_out():
    ledger = BatchLedger()
    ledger.remember(torch.ones(1), 3, [0])
    ledger.remember(torch.ones(1), 5, [0])
    assert ledger.take((torch.ones(1),), {}) == (5, [0])
    assert ledger.take((), {}) == (3, [0])


def test_batches_never_given_to_run_are_forgotten_beyond_sixteen():
    ledger = BatchLedger()
    batches = [torch.full((1,), float(i)) for i in range(20)]
    for i, b in enumerate(batches):
        ledger.remember(b, i, None)
    assert ledger.take((batches[3],), {}) == (19, None)  # forgotten: falls back to the latest
    assert ledger.take((batches[4],), {}) == (4, None)


def test_a_batch_without_tensors_is_not_remembered():
    ledger = BatchLedger()
    ledger.remember([], 3, None)
    assert ledger.take((), {}) == (None, None)
