"""compute_average_loss and scale_regularization_loss (TF's global-batch rule)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phalanx


def test_compute_average_loss_cases(mirrored_2cpu):
    per_example = torch.tensor([1.0, 2.0, 3.0])
    assert phalanx.compute_average_loss(per_example).item() == 2.0  # default strategy: local batch
    assert phalanx.compute_average_loss(per_example, global_batch_size=6).item() == 1.0
    weighted = phalanx.compute_average_loss(
        torch.ones(2, 3), sample_weight=torch.tensor([1.0, 0.0]), global_batch_size=2
    )
    assert weighted.item() == 1.5
    empty = phalanx.compute_average_loss(torch.zeros(0, requires_grad=True))
    assert empty.item() == 0.0
    assert empty.requires_grad
    assert phalanx.compute_average_loss(np.array([2.0, 4.0]), global_batch_size=4).item() == 1.5
    # TF's fallback rule without distributed input: local size x replicas
    values = mirrored_2cpu.run(lambda: phalanx.compute_average_loss(torch.tensor([2.0, 2.0])))
    assert [v.item() for v in mirrored_2cpu.experimental_local_results(values)] == [1.0, 1.0]
    reg = mirrored_2cpu.run(lambda: phalanx.scale_regularization_loss(torch.tensor([1.0, 3.0])))
    assert mirrored_2cpu.experimental_local_results(reg)[0].item() == 2.0
    with pytest.raises(ValueError, match="rank >= 1"):
        phalanx.compute_average_loss(torch.tensor(1.0))
    with pytest.raises(ValueError, match="positive integer"):
        phalanx.compute_average_loss(per_example, global_batch_size=0)
    with pytest.raises(ValueError, match="positive integer"):
        phalanx.compute_average_loss(per_example, global_batch_size=2.5)
    with mirrored_2cpu.scope():
        with pytest.raises(RuntimeError, match="cross-replica context without a global_batch_size"):
            phalanx.compute_average_loss(per_example)
        with pytest.raises(RuntimeError, match="scale_regularization_loss was called in cross-replica"):
            phalanx.scale_regularization_loss(per_example)
