"""`VariablePolicy.reading_together`: several sync-on-read reads from one cross-worker sum.

The workers are simulated in one process: a strategy of two local replicas that counts as one of
two workers, whose cross-worker all-reduce returns twice its input (a peer with the same state)
and counts its calls. Real workers: tests/multiprocess/test_multi_worker.py (fit's logs).
"""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.strategies.strategy import Strategy


class _OneOfTwoWorkers(Strategy):
    def __init__(self) -> None:
        super().__init__(["cpu:0", "cpu:1"], num_workers=2, worker_index=0)
        self.all_reduces = 0

    def cross_worker_all_reduce(self, tensor, op, options=None):
        self.all_reduces += 1
        return tensor * 2  # the other worker holds the same values


@pytest.fixture
def measured():
    strategy = _OneOfTwoWorkers()
    with strategy.scope():
        mean = phalanx.metrics.Mean()
        total = phalanx.metrics.Sum(dtype=torch.float64)
    strategy.run(lambda: (mean.update_state(torch.tensor([1.0, 3.0])), total.update_state(torch.ones(3))))
    yield strategy, mean, total
    strategy._threads.close()


def test_reads_inside_make_one_all_reduce_per_dtype_and_give_the_same_values(measured):
    strategy, mean, total = measured
    one_by_one = (mean.result().item(), total.result().item())
    assert strategy.all_reduces == 3  # mean's total and count, the sum's total
    assert one_by_one == (2.0, 12.0)  # (4 + 4) * 2 / ((2 + 2) * 2); 3 * 2 replicas * 2 workers
    strategy.all_reduces = 0
    states = [*mean.buffers(), *total.buffers()]
    with strategy.variable_policy.reading_together(states):
        assert (mean.result().item(), total.result().item()) == one_by_one
        assert mean.result().item() == one_by_one[0]  # read again: still no collective
    assert strategy.all_reduces == 2  # float32 (mean's two states) and float64 (the sum)


def test_a_state_written_inside_is_read_afresh(measured):
    strategy, mean, _ = measured
    with strategy.variable_policy.reading_together(list(mean.buffers())):
        mean.reset_state()
        assert mean.result().item() == 0.0
    assert strategy.all_reduces == 1 + 2  # the packed sum, then both states again


def test_one_worker_reads_as_before(mirrored_2cpu):
    with mirrored_2cpu.scope():
        mean = phalanx.metrics.Mean()
    mirrored_2cpu.run(lambda: mean.update_state(torch.tensor([1.0, 3.0])))
    with mirrored_2cpu.variable_policy.reading_together(list(mean.buffers())):
        assert mean.result().item() == 2.0
