"""The tf.distribute custom training loop reproduces TensorFlow's recorded trajectories."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phalanx
from support import oracle
from support.strategies import InProcessRunner

SINGLE = ["default_strategy", "one_device"]
TWO_REPLICAS = ["mirrored_2cpu", "central_storage_2cpu", "mwms_2workers"]


def _check(case: str, runner, prefix: str = "", n: int = 256, gbs=oracle.GLOBAL_BATCH):
    """Run the loop on every process of ``runner``; each matches the reference. Returns the
    examples each replica saw per step (the processes' replicas in order) and the case's facts."""
    ref, meta = oracle.reference(case)
    results = runner.run(oracle.run_ctl, n, gbs)
    for losses, state, _ in results:
        np.testing.assert_allclose(losses, ref[f"{prefix}losses"], **oracle.LOSS_TOL)
        for name, value in state.items():
            assert type(value).__name__ == "Tensor"  # plain tensors, loadable without phalanx
            np.testing.assert_allclose(value.numpy(), ref[f"{prefix}final/torch/{name}"], **oracle.WEIGHT_TOL)
    steps = zip(*(seen for _, _, seen in results), strict=True)
    return [[replica for process in step for replica in process] for step in steps], meta


@pytest.mark.parametrize("runner", SINGLE, indirect=True)
def test_single_device_loop_matches_ctl_single(runner):
    _check("ctl_single", runner)


@pytest.mark.parametrize("runner", TWO_REPLICAS, indirect=True)
def test_two_replica_loop_matches_ctl_mirrored(runner):
    seen, meta = _check("ctl_mirrored", runner)
    assert seen == meta["replica_indices_per_step"]  # under mwms_2workers: worker 0 saw 0..15 at step 0


@pytest.mark.parametrize("runner", TWO_REPLICAS, indirect=True)
def test_uneven_dataset_fixed_global_batch(runner):
    seen, meta = _check("uneven250_mirrored", runner, n=250)
    assert seen == meta["replica_indices_per_step"]
    assert [len(r) for r in seen[-1]] == meta["last_batch_split"]


@pytest.mark.parametrize("runner", ["mirrored_2cpu"], indirect=True)
def test_uneven_dataset_without_global_batch_size_uses_true_count(runner):
    seen, meta = _check("uneven250_mirrored", runner, prefix="gbs_none/", n=250, gbs=None)
    assert seen[-1] == meta["variants"]["gbs_none"]["replica_indices_last_step"]


def test_true_global_count_for_odd_partial_batch(mirrored_2cpu):
    # 25 examples split 13 / 12: the loss averages over all 25, unlike TF's 13 * 2 = 26.
    x, y = oracle.dataset(25)
    with mirrored_2cpu.scope():
        model = oracle.OracleNet()
    dist = mirrored_2cpu.experimental_distribute_dataset([(x, y)])

    def step(xb, yb):
        return phalanx.nn.compute_average_loss(
            torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        )

    (xb, yb) = next(iter(dist))
    loss = mirrored_2cpu.reduce("sum", mirrored_2cpu.run(step, args=(xb, yb)), axis=None)
    expected = torch.nn.functional.cross_entropy(model(x), y)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize(
    "make", [lambda: phalanx.MirroredStrategy(["cpu:0"]), lambda: phalanx.CentralStorageStrategy(["cpu:0"])]
)
def test_single_replica_mirrored_and_central_storage_match_ctl_single(make):
    strategy = make()  # one replica: not a named fixture
    _check("ctl_single", InProcessRunner("mirrored_1cpu", strategy))
    strategy._threads.close()
