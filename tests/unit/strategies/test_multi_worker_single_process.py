"""MultiWorkerMirroredStrategy in one process (a cluster of one) and its configuration errors.

Cross-process behaviour is tested with real processes in tests/multiprocess and tests/faults.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
from torch import nn

import phalanx
from phalanx.cluster import SimpleClusterResolver
from phalanx.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from support import oracle


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_workers(index: int = 0) -> SimpleClusterResolver:
    workers = [f"127.0.0.1:{_port()}", f"127.0.0.1:{_port()}"]
    return SimpleClusterResolver({"worker": workers}, task_type="worker", task_id=index)


def test_a_cluster_of_one_trains_like_one_device_with_plain_parameters(tmp_path):
    strategy = MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 1
    assert strategy.worker_devices == ("cpu:0",)
    assert strategy.is_chief
    assert strategy.should_checkpoint
    assert strategy.cluster_resolver.num_workers == 1
    assert strategy.write_dirpath(str(tmp_path)) == str(tmp_path)
    losses, state, _ = oracle.run_ctl(strategy)
    ref, _ = oracle.reference("ctl_single")
    np.testing.assert_allclose(losses, ref["losses"], **oracle.LOSS_TOL)
    for name, value in state.items():
        np.testing.assert_allclose(value.numpy(), ref[f"final/torch/{name}"], **oracle.WEIGHT_TOL)
    with strategy.scope():
        layer = nn.Linear(2, 2)
    assert type(layer.weight) is nn.Parameter  # the DDP layout: no distributed variables
    strategy.close()
    strategy.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"run was called after close\(\)"):
        strategy.run(lambda: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cluster_of_one_on_the_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    strategy = MultiWorkerMirroredStrategy(devices=["cuda:0"])
    assert strategy._backend == "nccl"  # AUTO: every local device is a GPU
    with strategy.scope():
        layer = nn.Linear(2, 2)
    assert type(layer.weight) is nn.Parameter
    assert layer.weight.device.type == "cuda"
    losses, state, _ = oracle.run_ctl(strategy)
    ref, _ = oracle.reference("ctl_single")
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-4, atol=1e-5)
    for name, value in state.items():
        np.testing.assert_allclose(value.cpu().numpy(), ref[f"final/torch/{name}"], rtol=1e-4, atol=1e-5)
    strategy.close()


def test_two_local_replicas_of_one_worker_equal_mirrored():
    strategy = MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
    mirrored = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        assert strategy.num_replicas_in_sync == 2
        losses, state, _ = oracle.run_ctl(strategy)
        ref_losses, ref_state, _ = oracle.run_ctl(mirrored)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-7)
        for name, value in state.items():
            torch.testing.assert_close(value, ref_state[name])
    finally:
        strategy.close()
        mirrored._threads.close()


def test_a_ps_job_is_refused():
    resolver = SimpleClusterResolver(
        {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, task_type="worker", task_id=0
    )
    with pytest.raises(ValueError, match="does not use parameter servers.*HINT: use ParameterServerStrategy"):
        MultiWorkerMirroredStrategy(resolver)


def test_an_evaluator_task_is_refused():
    resolver = SimpleClusterResolver(
        {"worker": ["127.0.0.1:1"], "evaluator": ["127.0.0.1:2"]}, task_type="evaluator", task_id=0
    )
    with pytest.raises(ValueError, match="runs on chief and worker tasks. Received: task evaluator:0"):
        MultiWorkerMirroredStrategy(resolver)


def test_nccl_without_gpus_is_refused():
    options = phalanx.CommunicationOptions(implementation="NCCL")
    with pytest.raises(ValueError, match=r"NCCL needs CUDA devices .* Received: devices \['cpu:0'\]"):
        MultiWorkerMirroredStrategy(communication_options=options, devices=["cpu:0"])


def test_communication_options_must_be_communication_options():
    with pytest.raises(TypeError, match="must be a phalanx.CommunicationOptions. Received: dict"):
        MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 3})


@pytest.mark.parametrize("name", ["join_timeout", "heartbeat_timeout"])
def test_timeouts_must_be_positive(name):
    with pytest.raises(ValueError, match=rf"{name} must be a positive number of seconds. Received: 0"):
        MultiWorkerMirroredStrategy(_two_workers(), **{name: 0})


def test_a_bad_timeout_variable_is_named(monkeypatch):
    monkeypatch.setenv("PHALANX_HEARTBEAT_TIMEOUT_SECONDS", "ten")
    with pytest.raises(ValueError, match="PHALANX_HEARTBEAT_TIMEOUT_SECONDS must be a positive number"):
        MultiWorkerMirroredStrategy(_two_workers())


def test_a_job_that_is_not_elastic_has_no_membership_and_cannot_re_form(monkeypatch):
    monkeypatch.delenv("PHALANX_MIN_WORKERS", raising=False)
    strategy = MultiWorkerMirroredStrategy()
    assert strategy.membership is None
    with pytest.raises(RuntimeError, match="is not elastic. HINT: set PHALANX_MIN_WORKERS"):
        strategy.reform()
    strategy.close()
