"""ModelParallelStrategy in one process (a mesh of one worker) and the layouts it refuses.

The refusals that need a split axis are checked on the plan itself (no processes); two and
four workers, and the refusal at a real scope, are in tests/multiprocess/test_model_parallel.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import phalanx
from phalanx.experimental import DeviceMesh, LayoutMap, ModelParallelStrategy
from phalanx.strategies.sharding.tensor_plan import (
    check_loss_parallel,
    layouts_of,
    parallel_styles,
    plan_layers,
)
from support import oracle


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _map(shape=(2,), names=("model",), **layouts) -> LayoutMap:
    made = LayoutMap(DeviceMesh(shape, names))
    for key, axes in layouts.items():
        made[key.replace("__", ".")] = axes
    return made


def _plan(model: nn.Module, layouts: LayoutMap) -> dict:
    layers = plan_layers(model, layouts_of(model, layouts, "batch"))
    return {
        layer.name: type(style)
        for layer, style in zip(layers, parallel_styles(model, layers).values(), strict=True)
    }


def test_one_worker_trains_like_one_device():
    strategy = ModelParallelStrategy(layout_map=_map((1,), ("model",)))
    try:
        assert (strategy.num_replicas_in_sync, strategy.first_replica_id) == (1, 0)
        losses, state, _ = oracle.run_ctl(strategy)
    finally:
        strategy.close()
    assert not dist.is_initialized(), "close() ends the process group it started"
    ref_losses, ref_state, _ = oracle.run_ctl(phalanx.OneDeviceStrategy("cpu:0"))
    np.testing.assert_allclose(losses, ref_losses, **oracle.LOSS_TOL)
    for key, value in ref_state.items():
        np.testing.assert_allclose(state[key].numpy(), value.numpy(), **oracle.WEIGHT_TOL)


def test_a_mesh_that_is_not_the_clusters_size_is_refused_at_creation():
    with pytest.raises(ValueError, match=r"mesh has 2 workers.*cluster has 1.*product is 1"):
        ModelParallelStrategy(layout_map=_map((2,), ("model",)))


def test_more_than_one_model_axis_and_a_non_map_are_refused():
    with pytest.raises(ValueError, match="one model axis besides the batch axis"):
        ModelParallelStrategy(layout_map=_map((1, 1), ("x", "y")))
    with pytest.raises(TypeError, match="LayoutMap"):
        ModelParallelStrategy(layout_map={"fc.weight": ("model", None)})  # type: ignore[arg-type]


def test_a_key_that_matches_no_parameter_is_refused_when_the_scope_closes():
    layouts = _map((1,), ("model",), **{r"0\.weight": ("model", None), "fc__weight": ("model", None)})
    strategy = ModelParallelStrategy(layout_map=layouts)
    try:
        with (
            pytest.raises(ValueError, match=r"keys \['fc.weight'\] match no parameter.*'0.weight'"),
            strategy.scope(),
        ):
            model = nn.Sequential(nn.Linear(2, 2))
        assert isinstance(model, nn.Module)
    finally:
        strategy.close()


def test_linear_and_embedding_splits_become_torchs_styles_paired_within_a_block():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4), nn.Linear(4, 8))
    layouts = _map(
        **{
            "0__weight": ("model", None),
            "1__weight": ("model", None),
            "1__bias": ("model",),
            "3__weight": (None, "model"),
            "4__weight": ("model", None),
        }
    )
    plan = _plan(model, layouts)
    assert plan == {"0": RowwiseParallel, "1": ColwiseParallel, "3": RowwiseParallel, "4": ColwiseParallel}
    styles = parallel_styles(model, plan_layers(model, layouts_of(model, layouts, "batch")))
    by_name = dict(zip(["0", "1", "3", "4"], styles.values(), strict=True))
    assert str(by_name["1"].output_layouts[0]) == "S(-1)"  # hands its part to the row split
    assert str(by_name["3"].input_layouts[0]) == "S(-1)"
    assert str(by_name["4"].output_layouts[0]) == "R"  # no partner: the model's output is whole


@pytest.mark.parametrize(
    ("layouts", "message"),
    [
        ({"0__weight": ("model",)}, r"has 1 entries; the parameter has 2 dimensions"),
        ({"0__weight": (None, "batch")}, r"batch axis 'batch'.*FSDP2"),
        ({"0__weight": ("model", None), "0__bias": (None,)}, r"must follow its weight's colwise split"),
        ({"0__bias": ("model",)}, r"split but its weight is not"),
        ({"1__weight": ("model",)}, r"splits the weights of nn.Linear and nn.Embedding.*LayerNorm"),
        (
            {"2__weight": ("model", None)},
            r"Dimension 0 of '2.weight' \(3\) is not divisible by the 2 workers",
        ),
    ],
)
def test_layouts_that_do_not_fit_are_refused_with_what_to_do(layouts, message):
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    with pytest.raises(ValueError, match=message):
        _plan(model, _map(shape=(2, 2), names=("batch", "model"), **layouts))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("4", None),
        ("9", r"Received: '9' \(no such module\)"),
        ("3", r"Received: '3' \(Linear, rowwise split\)"),
        ("1", r"Received: '1' \(Linear, split by columns and paired with a row split\)"),
        ("0", r"Received: '0' \(Embedding, rowwise split\)"),
    ],
)
def test_loss_parallel_names_an_unpaired_column_split_output_layer(name, message):
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4), nn.Linear(4, 8))
    layouts = _map(
        **{"0__weight": ("model", None), "1__weight": ("model", None), "3__weight": (None, "model")},
        **{"4__weight": ("model", None)},
    )
    layers = plan_layers(model, layouts_of(model, layouts, "batch"))
    if message is None:
        check_loss_parallel(model, layers, name)
        style = parallel_styles(model, layers, name)[id(model[4])]
        assert not style.use_local_output  # the logits stay a DTensor split over the classes
        return
    with pytest.raises(ValueError, match=message):
        check_loss_parallel(model, layers, name)
