"""MultiWorkerMirroredStrategy with real processes on 127.0.0.1 over gloo."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx
from support import oracle
from support.cluster import free_ports, run_cluster, run_python

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"


def _ctl(strategy, n, gpu=False):
    """The oracle's custom loop on this worker, with the layout it trained in (runs in each worker)."""
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
    losses, state, seen = oracle.run_ctl(strategy, n=n)
    return {
        "losses": losses,
        "state": {k: v.cpu() for k, v in state.items()},
        "seen": seen,
        "replicas": strategy.num_replicas_in_sync,
        "plain_parameters": len(strategy._plain),
        "buckets": strategy._buckets is not None,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_workers_sharing_a_gpu_over_gloo_reproduce_ctl_mirrored(mwms_2workers):
    # RING (gloo) lets two workers share one GPU, which NCCL refuses
    options = phalanx.CommunicationOptions(implementation="RING")
    results = mwms_2workers.run(
        _ctl, 256, True, strategy_kwargs={"devices": ["cuda:0"], "communication_options": options}
    )
    ref, _ = oracle.reference("ctl_mirrored")
    gpu_tol = {"rtol": 1e-4, "atol": 1e-5}  # kernels differ from the CPU recording
    for result in results:
        assert result["buckets"]  # gradient buckets of CUDA tensors, all-reduced by gloo
        np.testing.assert_allclose(result["losses"], ref["losses"], **gpu_tol)
        for name, value in result["state"].items():
            np.testing.assert_allclose(value.numpy(), ref[f"final/torch/{name}"], **gpu_tol)


def test_two_workers_with_two_local_replicas_equal_four_replicas(mwms_2workers):
    results = mwms_2workers.run(_ctl, 250, strategy_kwargs={"devices": ["cpu:0", "cpu:1"]})
    assert results[0]["replicas"] == 4
    assert results[0]["plain_parameters"] == 0  # mirrored variables
    assert not results[0]["buckets"]
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    losses, state, seen = oracle.run_ctl(strategy, n=250)
    strategy._threads.close()
    np.testing.assert_allclose(results[1]["losses"], losses, rtol=1e-6, atol=1e-6)
    assert results[0]["seen"]
    assert [s[0] for s in results[0]["seen"]] == [s[0] for s in seen]
    for name, value in state.items():
        np.testing.assert_allclose(results[1]["state"][name].numpy(), value.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("carried", [False, True], ids=["asked", "carried_over_gloo"])
def test_uneven_workers_end_the_epoch_together(tmp_path, carried):
    # carried: over gloo, each step's end-of-data flag rides with the step before's gradients
    args, env = (["wide"], {"PHALANX_SHARED_MEMORY": "0"}) if carried else ([], None)
    run_cluster(SCRIPTS / "uneven_epoch.py", tmp_path, *args, env=env).check()
    results = [json.loads((tmp_path / f"steps-{r}.json").read_text()) for r in range(2)]
    # 4 iterators: 2 epochs of from_function, FILE, OFF; 8 + 8 + 6 steps and each one's end
    assert results[0]["agreements"] == results[1]["agreements"] == (4 if carried else 26)
    assert results[0]["sizes"] == [4, 4, 0, 0] * 2  # worker 0 ran out: empty batches, same steps
    assert results[1]["sizes"] == [4, 4, 4, 4] * 2
    # FILE: worker 0 reads 32 rows (4 batches of 8, 4 per replica), worker 1 reads 8
    assert results[0]["file"] == [4] * 8
    assert results[1]["file"] == [4, 4] + [0] * 6
    # OFF: each worker reads its own dataset whole (24 and 16 rows)
    assert results[0]["off"] == [4] * 6
    assert results[1]["off"] == [4] * 4 + [0] * 2
    assert results[0]["weight"] == results[1]["weight"]


def _expected_collectives(n):
    rows = [[10.0 * r + i for i in range(r + 1)] for r in range(n)]
    flat = [v for row in rows for v in row]
    return {
        "replicas": n,
        "gather": flat,
        "reduce_sum_axis0": sum(flat),
        "reduce_mean_axis0": sum(flat) / len(flat),
        "reduce_sum": [n * (n + 1) / 2] * 2,
        "reduce_mean": [(n + 1) / 2] * 2,
    }


def _check_collectives(tmp_path, local):
    n = 2 * local
    results = []
    for rank in range(2):
        result = json.loads((tmp_path / f"checks-{rank}.json").read_text())
        assert result["is_chief"] is result["should_checkpoint"] is (rank == 0)
        for key, value in _expected_collectives(n).items():
            assert result[key] == pytest.approx(value), key
        ids = [rank * local + i for i in range(local)]  # global replica ids of this worker
        assert result["replica_sum"] == [n * (n + 1) / 2] * local
        assert result["replica_mean"] == [(n + 1) / 2] * local
        assert result["replica_gather"] == [_expected_collectives(n)["gather"]] * local
        assert result["replica_grad"] == [[float(n * (g + 1))] * 3 for g in ids]
        assert "fixed when it was created" in result["implementation_error"]
        results.append(result)
    return results


def test_reduce_gather_and_all_reduce_across_two_workers_of_two_replicas(tmp_path):
    run_cluster(SCRIPTS / "collectives_checks.py", tmp_path, 2).check()
    _check_collectives(tmp_path, 2)


@pytest.mark.parametrize("transport", ["shared_memory", "gloo"])
def test_collectives_and_gradient_buckets_with_one_replica_per_worker(tmp_path, transport):
    env = {"PHALANX_SHARED_MEMORY": "1" if transport == "shared_memory" else "0"}
    run = run_cluster(SCRIPTS / "collectives_checks.py", tmp_path, 1, env=env).check()
    assert "[worker-0] after close: " in run.output
    assert "[worker-1] after close: " in run.output
    for rank, result in enumerate(_check_collectives(tmp_path, 1)):
        assert result["uses_shared_memory"] == (transport == "shared_memory")
        assert result["plain_parameters"]
        assert result["initial_values_from_chief"]
        # reverse creation order in 4 KB buckets (the 1 MB first-bucket cap does not bind);
        # a gradient of 4 KB or more is all-reduced alone, in place
        assert result["buckets"] == [
            [[40, 30]],
            [[2], [2, 30], [3], [3, 3], [40], [30]],
            [[30, 30], [30]],
            [[30, 20]],
        ]
        # bucketed sums equal one plain all-reduce per tensor (unused here or everywhere,
        # accumulated over two backward passes) and give the same weights
        assert result["bucket_mismatches"] == []
        assert result["second_optimizer_bias_grad"] == [2.0] * 4
        assert "not created in this strategy's scope" in result["outside_scope_error"]
        chief_dir = str(tmp_path / "saved")
        assert result["write_dirpath"] == (chief_dir if rank == 0 else f"{chief_dir}/workertemp_1")
        if rank == 1:  # made for the worker (the chief's folder is the caller's to make)
            assert result["write_dirpath_exists"]
        assert result["temp_removed"]


def test_keras_under_two_workers_restore_metrics_and_predict_order(tmp_path, one_device):
    from phalanx.checkpoint import Checkpoint

    torch.manual_seed(3)
    with one_device.scope():
        net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    path = Checkpoint(model=net).write(str(tmp_path / "one_device.pt"))
    run_cluster(SCRIPTS / "keras_checks.py", path, tmp_path).check()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(53, 4, generator=g), torch.randint(0, 3, (53,), generator=g)
    with torch.no_grad():
        expected = net(x)
    reference = phalanx.metrics.SparseCategoricalAccuracy()
    reference.update_state(y[:25], expected[:25])
    loss = phalanx.losses.SparseCategoricalCrossentropy(from_logits=True)(y, expected).item()
    for rank in range(2):
        result = json.loads((tmp_path / f"keras-{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(result["weight"]), net[0].weight.detach())
        torch.testing.assert_close(torch.tensor(result["predictions"]), expected)  # input order, 53 = 6x8 + 5
        assert result["metric"] == pytest.approx(reference.result().item())
        assert result["loss"] == pytest.approx(loss, rel=1e-5)
        assert result["logs"] == result["one_by_one"]  # the same sums, exactly (2 workers)
        assert result["logs_collectives"] == 1


def test_sync_batch_norm_across_workers(tmp_path):
    run_cluster(SCRIPTS / "sync_bn.py", tmp_path).check()
    x = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3) ** 1.5
    reference = torch.nn.BatchNorm1d(3)
    expected = reference(x)
    for rank in range(2):
        result = json.loads((tmp_path / f"bn-{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(result["out"]), expected.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(result["mean"]), reference.running_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(result["var"]), reference.running_var, rtol=1e-4, atol=1e-4)


def test_per_call_timeout_of_communication_options():
    run = run_cluster(SCRIPTS / "per_call_timeout.py")
    assert run.returncodes == {"worker-0": 7, "worker-1": 0}, run.output
    assert "[worker-0] timed out: all_reduce failed on worker:0" in run.output
    assert "no answer within 1s" in run.output


def _run_program(tmp_path, launcher):
    script = [SCRIPTS / "tf_config_program.py", tmp_path]
    if launcher == "torchrun":  # torchrun's agent serves the rendezvous store itself
        port = free_ports(1)[0]
        done = run_python(
            "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port, *script, timeout=90
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    run = run_cluster(*script, chief=True, workers=1, timeout=90).check()  # TF_CONFIG only
    return [json.loads(run[task].output.strip().splitlines()[-1]) for task in ("chief-0", "worker-0")]


@pytest.mark.parametrize(
    ("launcher", "tasks", "resolver"),
    [
        ("tf_config", ["chief:0", "worker:0"], "TFConfigClusterResolver"),
        ("torchrun", ["worker:0", "worker:1"], "TorchrunClusterResolver"),
    ],
)
def test_the_same_program_configured_by_tf_config_or_torchrun(tmp_path, launcher, tasks, resolver):
    first, second = _run_program(tmp_path, launcher)
    assert [first["task"], second["task"]] == tasks
    assert [first["rank"], second["rank"]] == [0, 1]
    assert [first["is_chief"], second["is_chief"]] == [True, False]
    assert first["resolver"] == second["resolver"] == resolver
    assert first["replicas"] == second["replicas"] == 2
    for key in ("loss", "weight", "bias"):
        assert first[key] == second[key]  # bit for bit: same broadcast start, same sums
    assert first["weight"] == pytest.approx(3.0, abs=1e-2)
    assert first["bias"] == pytest.approx(0.5, abs=1e-2)
    saved = torch.load(tmp_path / "model" / "weights.pt")
    assert saved["weight"].item() == first["weight"]
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [
        "final.pt",
        "weights.pt",
    ]  # no workertemp left
    assert (tmp_path / "model" / "final.pt").is_file()
