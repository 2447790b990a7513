"""CUDA paths (skipped without a GPU): placement, oracle parity on the GPU, CPU parameter device."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx
from support import oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GPU_TOL = {"rtol": 1e-4, "atol": 1e-5}  # TF32 / kernel choice differ from the CPU recording


def test_one_device_places_everything_on_the_gpu():
    strategy = phalanx.OneDeviceStrategy("/gpu:0")
    with strategy.scope():
        layer = torch.nn.BatchNorm1d(3)
    assert layer.weight.device.type == "cuda"
    assert layer.running_mean.device.type == "cuda"
    batch = next(iter(strategy.experimental_distribute_dataset([torch.ones(4, 3)])))
    assert batch.device.type == "cuda"


@pytest.mark.parametrize(
    "make",
    [
        lambda: phalanx.OneDeviceStrategy("cuda:0"),
        lambda: phalanx.MirroredStrategy(["cuda:0"]),
        lambda: phalanx.CentralStorageStrategy(["cuda:0"], parameter_device="cpu"),
    ],
)
def test_ctl_oracle_on_the_gpu(make):
    torch.backends.cuda.matmul.allow_tf32 = False
    losses, state, _ = oracle.run_ctl(make())
    ref, _ = oracle.reference("ctl_single")
    np.testing.assert_allclose(losses, ref["losses"], **GPU_TOL)
    for name, value in state.items():
        np.testing.assert_allclose(value.cpu().numpy(), ref[f"final/torch/{name}"], **GPU_TOL)


def test_fit_on_the_gpu_and_load_on_cpu(tmp_path):
    strategy = phalanx.MirroredStrategy()
    x, y = oracle.dataset(128)
    with strategy.scope():
        model = phalanx.Model(oracle.OracleNet())
        model.compile(
            "adam", loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    model.save_weights(str(tmp_path / "w.pt"))
    cpu = oracle.OracleNet()
    cpu.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    torch.testing.assert_close(cpu(x), model.predict(x).cpu(), rtol=1e-4, atol=1e-4)


def test_nccl_cross_device_ops_need_two_gpus_or_reduce():
    ops = phalanx.NcclAllReduce()
    value = phalanx.PerReplica([torch.ones(2, device="cuda:0")])
    torch.testing.assert_close(ops.reduce("sum", value, "cuda:0"), torch.ones(2, device="cuda:0"))


def test_two_workers_share_the_gpu_over_gloo(tmp_path):
    from phalanx.cluster import launch

    script = Path(__file__).resolve().parents[1] / "multiprocess" / "scripts" / "sync_bn.py"
    out = io.StringIO()
    env = {
        "PHALANX_TEST_IMPLEMENTATION": "RING",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    code = launch(str(script), workers=2, args=[str(tmp_path)], env=env, out=out, timeout=120)
    assert code == 0, out.getvalue()
    assert (tmp_path / "bn-1.json").exists()
