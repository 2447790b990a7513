"""phalanx.mixed_precision policies: TF's names, the global policy, autocast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx import mixed_precision


@pytest.fixture(autouse=True)
def _restore_global_policy():
    before = mixed_precision.global_policy()
    yield
    mixed_precision.set_global_policy(before)


@pytest.mark.parametrize(
    ("name", "compute", "scaling"),
    [
        ("float32", "float32", False),
        ("mixed_float16", "float16", True),
        ("mixed_bfloat16", "bfloat16", False),
    ],
)
def test_policies_keep_variables_in_float32_and_compute_in_their_dtype(name, compute, scaling):
    policy = mixed_precision.Policy(name)
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (name, compute, "float32")
    assert policy.needs_loss_scaling is scaling
    layer = nn.Linear(4, 2)
    with policy.autocast("cpu"):
        out = layer(torch.ones(1, 4))
    assert out.dtype == policy.torch_compute_dtype
    assert layer.weight.dtype == torch.float32


def test_an_unknown_policy_name_is_refused_with_the_names():
    names = r"\['float32', 'mixed_bfloat16', 'mixed_float16'\]"
    with pytest.raises(ValueError, match=rf"one of {names}\. Received: 'float16'"):
        mixed_precision.Policy("float16")


def test_the_global_policy_is_float32_until_set_by_name_or_policy():
    assert mixed_precision.global_policy() == mixed_precision.Policy("float32")
    mixed_precision.set_global_policy("mixed_bfloat16")
    assert mixed_precision.global_policy().compute_dtype == "bfloat16"
    mixed_precision.set_global_policy(mixed_precision.Policy("float32"))
    assert mixed_precision.global_policy().name == "float32"
    with pytest.raises(TypeError, match="takes a Policy or its name. Received: dtype"):
        mixed_precision.set_global_policy(torch.float16)
