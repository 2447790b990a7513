"""estimate_memory's arithmetic: each part from the model's shapes, the optimizer and the strategy."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from phalanx.cli import main
from phalanx.experimental import estimate_memory, plan_memory
from phalanx.memory.estimate import (
    BASE_RUNTIME_BYTES,
    GATHERED_UNITS,
    KEPT_INPUT_UNITS,
    RAW_TP_HEAP_SHARES,
    REDUCTION_SHARE,
    RETAINED_HEAP_UNITS,
    SUBGROUP_WORKS_UNITS,
    activation_bytes,
    optimizer_factors,
)

MiB = 1 << 20
WIDTH, LAYERS = 256, 3
P = LAYERS * (WIDTH * WIDTH + WIDTH) * 4  # parameter bytes, float32
U = (WIDTH * WIDTH + WIDTH) * 4  # one Linear's own parameters: the largest unit


def _mlp(width: int = WIDTH, layers: int = LAYERS) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def _gathered(units: float, unit: int, est) -> int:
    """The backward's units, counted where they exceed the gradients and the step's temporaries."""
    return max(0, int(units * unit) - est.parts["gradients"] - est.parts["optimizer_step"])


def test_multi_worker_mirrored_holds_the_whole_state_on_every_worker():
    est = estimate_memory(_mlp(), torch.optim.Adam, strategy="multi_worker_mirrored", num_workers=2)
    assert est.parts["parameters"] == P
    assert est.parts["gradients"] == P
    assert est.parts["optimizer_state"] == 2 * P  # Adam's two moments
    assert est.parts["optimizer_step"] == P
    assert est.parts["reduction"] == int(REDUCTION_SHARE * P)  # the gradients' staged buckets
    assert est.parts["gathered_units"] == 0
    assert est.parts["whole_model"] == 0  # its parameters are the whole model
    assert est.peak == sum(est.parts.values())


@pytest.mark.parametrize(
    ("strategy", "workers", "segments_mib"),
    [
        ("multi_worker_mirrored", 2, 2 * 2 * 4),  # all-reduce slots; broadcasts: the same 4 MiB ones
        ("multi_worker_mirrored", 4, 2 * 4 * 4 + 2 * 2),  # and the chief's 2 MiB broadcast slots
        ("fully_sharded", 2, 16),  # one 8 MiB set of slots per call, 2 sets, whatever the workers
        ("fully_sharded", 4, 16),
    ],
)
def test_the_runtime_counts_the_shared_memory_segments_a_worker_reads(strategy, workers, segments_mib):
    est = estimate_memory(_mlp(2048, 4), torch.optim.Adam, strategy=strategy, num_workers=workers)
    assert est.parts["runtime"] == BASE_RUNTIME_BYTES + segments_mib * MiB


@pytest.mark.parametrize("workers", [2, 4])
def test_fully_sharded_keeps_a_share_of_the_state_plus_the_gathered_units(workers):
    est = estimate_memory(_mlp(), torch.optim.Adam, strategy="fully_sharded", num_workers=workers)
    assert est.parts["parameters"] == P // workers
    assert est.parts["gradients"] == P // workers
    assert est.parts["optimizer_state"] == 2 * P // workers
    assert est.parts["reduction"] == 0
    assert est.parts["gathered_units"] == _gathered(GATHERED_UNITS, U, est) > 0
    assert est.parts["allocator"] == est.parts["whole_model"] == 0


def test_without_release_memory_fsdp2_and_glibc_keep_gathered_units():
    kept = estimate_memory(_mlp(), torch.optim.Adam, num_workers=4, release_memory=False)
    assert kept.parts["gathered_units"] == _gathered(GATHERED_UNITS + KEPT_INPUT_UNITS, U, kept)
    assert kept.parts["allocator"] == int(RETAINED_HEAP_UNITS * U)


def test_a_model_built_whole_is_held_whole_while_it_is_sharded():
    big = _mlp(2048, 4)  # 64 MiB: on 4 workers, all of it plus the shards outgrow training
    est = estimate_memory(big, torch.optim.SGD, num_workers=4, built_whole=True)
    whole = 4 * (2048 * 2048 + 2048) * 4
    training = sum(v for k, v in est.parts.items() if k not in ("runtime", "whole_model"))
    assert est.parts["whole_model"] == whole + whole // 4 + whole // 4 - training > 0
    assert estimate_memory(big, torch.optim.SGD, num_workers=4).parts["whole_model"] == 0


def test_one_worker_gathers_nothing_and_reduces_nothing():
    est = estimate_memory(_mlp(), torch.optim.SGD, strategy="fully_sharded", num_workers=1)
    assert est.parts["gathered_units"] == 0
    assert est.parts["runtime"] == BASE_RUNTIME_BYTES
    assert est.parts["optimizer_state"] == 0


def test_mixed_precision_gathers_the_units_in_the_half_dtype():
    full = estimate_memory(_mlp(), None, strategy="fully_sharded", num_workers=2)
    half = estimate_memory(_mlp(), None, strategy="fully_sharded", num_workers=2, mixed_precision="bfloat16")
    assert full.parts["gathered_units"] == _gathered(GATHERED_UNITS, U, full)
    assert half.parts["gathered_units"] == _gathered(GATHERED_UNITS, U // 2, half)
    assert half.parts["gathered_units"] < full.parts["gathered_units"]
    assert half.parts["parameters"] == full.parts["parameters"]  # the shards stay float32


def test_model_parallel_splits_the_state_over_the_mesh_and_gathers_along_the_batch_axis():
    est = estimate_memory(_mlp(), torch.optim.Adam, strategy="model_parallel", mesh_shape=(2, 2))
    assert est.num_workers == 4
    assert est.parts["parameters"] == P // 4
    assert est.parts["gathered_units"] == _gathered(GATHERED_UNITS, U // 2, est)
    assert est.parts["allocator"] == int(SUBGROUP_WORKS_UNITS * (U // 2))  # the batch axis's gloo works
    tensor_parallel = estimate_memory(_mlp(), torch.optim.Adam, strategy="model_parallel", mesh_shape=(4,))
    assert tensor_parallel.parts["gathered_units"] == tensor_parallel.parts["allocator"] == 0


def test_raw_torch_has_no_segments_or_subgroup_works_and_glibc_keeps_what_it_served():
    """torchtitan's recipe written with torch alone: torch's gloo groups (no phalanx transport
    or RecentWorks), FSDP2 and glibc as they are."""
    kwargs: dict = {"strategy": "model_parallel", "raw_torch": True}
    two_d = estimate_memory(_mlp(), torch.optim.Adam, mesh_shape=(2, 2), **kwargs)
    assert two_d.parts["runtime"] == BASE_RUNTIME_BYTES
    assert two_d.parts["allocator"] == int(RETAINED_HEAP_UNITS * (U // 2))  # no subgroup works
    tensor_parallel = estimate_memory(_mlp(), torch.optim.Adam, mesh_shape=(2,), **kwargs)
    assert tensor_parallel.parts["allocator"] == RAW_TP_HEAP_SHARES * P // 2
    raw_fsdp2 = estimate_memory(_mlp(), torch.optim.Adam, num_workers=4, raw_torch=True)
    as_it_is = {"release_memory": False, "runtime_bytes": BASE_RUNTIME_BYTES}
    assert raw_fsdp2.parts == estimate_memory(_mlp(), torch.optim.Adam, num_workers=4, **as_it_is).parts


def test_optimizer_factors_follow_the_optimizer_and_its_options():
    weight = [nn.Parameter(torch.zeros(2))]
    assert optimizer_factors(torch.optim.AdamW) == (2, 1)
    assert optimizer_factors(torch.optim.SGD(weight, lr=0.1)) == (0, 0)
    assert optimizer_factors(torch.optim.SGD(weight, lr=0.1, momentum=0.9)) == (1, 0)
    assert optimizer_factors(torch.optim.RMSprop(weight, momentum=0.9, centered=True)) == (3, 1)

    class MyAdam(torch.optim.Adam):
        pass

    assert optimizer_factors(MyAdam) == (2, 1)  # a subclass counts as its base


def test_an_unknown_optimizer_is_refused_with_the_tuple_to_pass_instead():
    class Lion(torch.optim.Optimizer):
        pass

    with pytest.raises(ValueError, match=r"Received: Lion\. HINT: pass optimizer=\(state, step\)"):
        estimate_memory(_mlp(), Lion, num_workers=2)
    est = estimate_memory(_mlp(), (1.0, 0.0), strategy="multi_worker_mirrored", num_workers=2)
    assert est.parts["optimizer_state"] == P


def test_activations_are_what_the_forward_keeps_counted_on_the_meta_device():
    batch = 8
    # each Linear keeps its input, each ReLU its output, which is the next Linear's input (one
    # tensor, counted once): the model's input and one per layer, (batch, WIDTH) float32; the
    # largest once more (backward's gradient of it)
    expected = (LAYERS + 2) * batch * WIDTH * 4
    assert activation_bytes(_mlp(), (batch, WIDTH)) == expected
    assert activation_bytes(_mlp(), (batch, WIDTH), torch.bfloat16) == expected // 2
    est = estimate_memory(_mlp(), num_workers=2, sample_input=(WIDTH,), per_worker_batch=batch)
    assert est.parts["activations"] == expected


def test_a_model_on_the_cpu_is_measured_without_touching_its_parameters():
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    assert activation_bytes(model, torch.ones(2, 4)) == 2 * 2 * 4 * 4  # its input, twice
    assert torch.equal(model.weight, before)


def test_the_plan_says_which_strategies_fit_the_budget():
    mirrored = estimate_memory(_mlp(), num_workers=4, strategy="multi_worker_mirrored").peak
    sharded = estimate_memory(_mlp(), num_workers=4, strategy="fully_sharded").peak
    plan = plan_memory(_mlp(), num_workers=4, budget_bytes=(mirrored + sharded) / 2)
    assert "fully_sharded" in plan.fitting
    assert "multi_worker_mirrored" not in plan.fitting
    assert "fits" in str(plan)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "mirrored", "num_workers": 2}, r"strategy must be one of .* Received: 'mirrored'"),
        ({"strategy": "fully_sharded"}, r"needs num_workers >= 1\. Received: num_workers=None"),
        ({"strategy": "model_parallel"}, r"needs mesh_shape=.* Received: mesh_shape=None"),
        ({"strategy": "model_parallel", "mesh_shape": (2, 2), "num_workers": 2}, r"has 4 workers, but num"),
        ({"num_workers": 2, "mixed_precision": "int8"}, r"floating dtype .* Received: 'int8'"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_pass(kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(_mlp(), **kwargs)


def test_the_command_prints_the_plan(monkeypatch, capsys):
    module = types.ModuleType("memory_models")
    module.build = lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "memory_models", module)
    assert (
        main(
            [
                "estimate-memory",
                "memory_models:build",
                "--workers",
                "2",
                "--input-shape",
                str(WIDTH),
                "--budget-mb",
                "1000",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fully_sharded (2 workers): peak" in out
    assert "fits 1000 MiB per worker: multi_worker_mirrored, fully_sharded, model_parallel" in out
    with pytest.raises(SystemExit, match="the model is module:function. Received: 'memory_models'"):
        main(["estimate-memory", "memory_models", "--workers", "2"])
