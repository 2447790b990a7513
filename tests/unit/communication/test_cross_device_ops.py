"""CrossDeviceOps.can_sum_in_place: each implementation says whether replicas may sum their
gradients in place over shared memory (the gradient path's fast route)."""

from __future__ import annotations

import pytest
import torch

from phalanx.communication.local.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)

CPUS = (torch.device("cpu"), torch.device("cpu"))
WITH_A_GPU = (torch.device("cpu"), torch.device("cuda", 0))  # a device name needs no GPU


def _sum(tensors):
    return torch.stack(tensors).sum(0)


class _OwnReduce(ReductionToOneDevice):
    """A subclass with its own arithmetic, which the base answer cannot vouch for."""

    def reduce_to(self, reduce_op, tensors, device):
        return super().reduce_to(reduce_op, tensors, device) * 2


class _OwnReduceAndAnswer(_OwnReduce):
    def can_sum_in_place(self, devices):
        return True


@pytest.mark.parametrize(
    ("ops", "devices", "expected"),
    [
        (ReductionToOneDevice(), CPUS, True),
        (ReductionToOneDevice("cpu"), CPUS, True),
        (ReductionToOneDevice(), WITH_A_GPU, False),
        (ReductionToOneDevice("cuda:0"), CPUS, False),
        (ReductionToOneDevice(accumulation_fn=_sum), CPUS, False),
        (_OwnReduce(), CPUS, False),
        (_OwnReduceAndAnswer(), CPUS, True),
        (CrossDeviceOps(), CPUS, False),
        (HierarchicalCopyAllReduce(), CPUS, False),
        (NcclAllReduce(num_packs=2), WITH_A_GPU, False),
    ],
    ids=[
        "default",
        "accumulate-on-cpu",
        "a-gpu-replica",
        "accumulate-on-gpu",
        "custom-accumulation",
        "subclass-with-own-reduce",
        "subclass-that-answers",
        "base",
        "hierarchical-copy",
        "nccl",
    ],
)
def test_can_sum_in_place_per_implementation(ops, devices, expected):
    assert ops.can_sum_in_place(devices) is expected


def test_the_in_place_answer_matches_reduce_to_on_the_cpu():
    ops = ReductionToOneDevice()
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])]
    assert ops.can_sum_in_place(CPUS)
    from phalanx.values import ReduceOp

    torch.testing.assert_close(ops.reduce_to(ReduceOp.SUM, grads, CPUS[0]), grads[0] + grads[1])
