"""The tf.distribute custom training loop reproduces TensorFlow's recorded trajectories."""

from __future__ import annotations

import numpy as np
import pytest

import phalanx
from support import oracle

SINGLE = ["default", "one_device"]
MULTI = ["mirrored_2cpu", "central_storage_2cpu"]


def _check(case: str, strategy, prefix: str = "", n: int = 256, gbs=oracle.GLOBAL_BATCH):
    ref, meta = oracle.reference(case)
    losses, state, seen = oracle.run_ctl(strategy, n=n, global_batch_size=gbs)
    np.testing.assert_allclose(losses, ref[f"{prefix}losses"], **oracle.LOSS_TOL)
    for name, value in state.items():
        assert type(value).__name__ == "Tensor"  # plain tensors, loadable without phalanx
        np.testing.assert_allclose(value.numpy(), ref[f"{prefix}final/torch/{name}"], **oracle.WEIGHT_TOL)
    return seen, meta


@pytest.mark.parametrize("name", SINGLE)
def test_single_device_loop_matches_ctl_single(name):
    from conftest import STRATEGY_FACTORIES

    _check("ctl_single", STRATEGY_FACTORIES[name]())


@pytest.mark.parametrize("name", MULTI)
def test_two_replica_loop_matches_ctl_mirrored(name):
    from conftest import STRATEGY_FACTORIES

    seen, meta = _check("ctl_mirrored", STRATEGY_FACTORIES[name]())
    assert seen == meta["replica_indices_per_step"]


@pytest.mark.parametrize("name", MULTI)
def test_uneven_dataset_fixed_global_batch(name):
    from conftest import STRATEGY_FACTORIES

    seen, meta = _check("uneven250_mirrored", STRATEGY_FACTORIES[name](), n=250)
    assert seen == meta["replica_indices_per_step"]
    assert [len(r) for r in seen[-1]] == meta["last_batch_split"]


def test_uneven_dataset_without_global_batch_size_uses_true_count(mirrored_2cpu):
    seen, meta = _check("uneven250_mirrored", mirrored_2cpu, prefix="gbs_none/", n=250, gbs=None)
    assert seen[-1] == meta["variants"]["gbs_none"]["replica_indices_last_step"]


def test_true_global_count_for_odd_partial_batch(mirrored_2cpu):
    # 25 examples split 13 / 12: the loss averages over all 25, unlike TF's 13 * 2 = 26.
    x, y = oracle.dataset(25)
    with mirrored_2cpu.scope():
        model = oracle.OracleNet()
    dist = mirrored_2cpu.experimental_distribute_dataset([(x, y)])

    def step(xb, yb):
        per_example = phalanx.nn.compute_average_loss(
            __import__("torch").nn.functional.cross_entropy(model(xb), yb, reduction="none")
        )
        return per_example

    (xb, yb) = next(iter(dist))
    loss = mirrored_2cpu.reduce("sum", mirrored_2cpu.run(step, args=(xb, yb)), axis=None)
    import torch

    expected = torch.nn.functional.cross_entropy(model(x), y)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_single_replica_mirrored_and_central_storage_match_ctl_single():
    for strategy in (phalanx.MirroredStrategy(["cpu:0"]), phalanx.CentralStorageStrategy(["cpu:0"])):
        _check("ctl_single", strategy)
