"""The Kubeflow manifests of examples/kubeflow, run as their operators would run them: each task
is a real process with exactly the variables its operator sets (TFJob's TF_CONFIG, PyTorchJob's
MASTER_*/WORLD_SIZE/RANK, TrainJob's PET_* read by torchrun), the command and replica counts read
from the manifest, 127.0.0.1 standing for the pods' service names. Every job ends at the weights
of the same program run as one process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from support.cluster import LocalCluster, free_ports, run_python

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.multiprocess

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "kubeflow"
PROGRAM = EXAMPLES / "train.py"


def _manifest(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def _argv(command: list[str], out: Path) -> list[str]:
    """The container's command on this machine: its program is examples/kubeflow/train.py, its
    output folder ``out``; ``torchrun`` is torch's module."""
    launcher, *args = command
    assert args[0] == "/app/train.py", command
    runner = [sys.executable] if launcher == "python" else [sys.executable, "-m", "torch.distributed.run"]
    return [*runner, str(PROGRAM), str(out), *args[2:]]


def _container(replica: dict) -> dict:
    (container,) = replica["template"]["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The program run as one process: its weights and final loss."""
    out = tmp_path_factory.mktemp("one")
    done = run_python(PROGRAM, out, timeout=120)
    assert done.returncode == 0, done.stderr
    return torch.load(out / "weights.pt"), json.loads((out / "result.json").read_text())["loss"]


def _check_weights(out: Path, one_process) -> None:
    weights, loss = one_process
    got = torch.load(out / "weights.pt")
    for key, value in weights.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)
    result = json.loads((out / "result.json").read_text())
    assert result["workers"] == 2
    assert result["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)


def test_tfjob_chief_worker_and_an_evaluator_outside_the_cluster(tmp_path, one_process):
    replicas = _manifest("tfjob.yaml")["spec"]["tfReplicaSpecs"]
    assert {_container(r)["name"] for r in replicas.values()} == {"tensorflow"}
    # the operator's cluster: every replica type but the evaluator, ports from the manifest's
    # tfjob-port (a free port each here, as pods have an address each)
    ports = iter(free_ports(sum(r["replicas"] for r in replicas.values())))
    cluster = {
        kind.lower(): [f"127.0.0.1:{next(ports)}" for _ in range(spec["replicas"])]
        for kind, spec in replicas.items()
        if kind != "Evaluator"
    }
    with LocalCluster(0) as tasks:
        for kind, spec in replicas.items():
            for index in range(spec["replicas"]):
                tf_config = {"cluster": cluster, "task": {"type": kind.lower(), "index": index}}
                tf_config["environment"] = "cloud"
                argv = _argv(_container(spec)["command"], tmp_path)
                tasks.start_task(f"{kind.lower()}-{index}", argv, {"TF_CONFIG": json.dumps(tf_config)})
        run = tasks.wait(180, names=["chief-0", "worker-0", "evaluator-0"])
    run.check()
    assert "evaluator" not in cluster
    _check_weights(tmp_path, one_process)
    evaluation = json.loads((tmp_path / "evaluation.json").read_text())  # the evaluator's, of the checkpoint
    assert evaluation["loss"] == pytest.approx(one_process[1], rel=1e-5, abs=1e-6)


def test_pytorchjob_master_and_worker_without_local_rank(tmp_path, one_process):
    replicas = _manifest("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]
    master = _container(replicas["Master"])
    assert master["name"] == "pytorch"
    assert [p["name"] for p in master["ports"]] == ["pytorchjob-port"]
    port = free_ports(1)[0]  # the master's pytorchjob-port
    world = sum(spec["replicas"] for spec in replicas.values())
    with LocalCluster(0) as tasks:
        for kind, spec in replicas.items():
            for index in range(spec["replicas"]):
                rank = index if kind == "Master" else index + 1  # as the operator numbers them
                env = {
                    "PYTHONUNBUFFERED": "0",
                    "MASTER_ADDR": "127.0.0.1",  # phalanx-pytorchjob-master-0
                    "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(world),
                    "RANK": str(rank),
                }
                tasks.start_task(f"{kind.lower()}-{index}", _argv(_container(spec)["command"], tmp_path), env)
        run = tasks.wait(180, names=["master-0", "worker-0"])
    run.check()
    assert "LOCAL_RANK" not in tasks.env
    _check_weights(tmp_path, one_process)


def _trainjob_env(trainer: dict, node: int, port: int) -> dict[str, str]:
    """What the torch runtime sets on node ``node`` of the TrainJob: torchrun's arguments only."""
    return {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_NODE_RANK": str(node),
        "PET_MASTER_ADDR": "127.0.0.1",  # phalanx-trainjob-node-0-0.phalanx-trainjob
        "PET_MASTER_PORT": str(port),
    }


def test_trainjob_nodes_under_torchrun(tmp_path, one_process):
    trainer = _manifest("trainjob.yaml")["spec"]["trainer"]
    assert trainer["command"][0] == "torchrun"
    port = free_ports(1)[0]
    with LocalCluster(0) as tasks:
        names = [f"node-{node}" for node in range(trainer["numNodes"])]
        for node, name in enumerate(names):
            tasks.start_task(name, _argv(trainer["command"], tmp_path), _trainjob_env(trainer, node, port))
        run = tasks.wait(180, names=names)
    run.check()
    _check_weights(tmp_path, one_process)


def test_trainjob_without_torchrun_fails_at_once_naming_torchrun(tmp_path):
    trainer = _manifest("trainjob.yaml")["spec"]["trainer"]
    command = ["python", *trainer["command"][1:]]  # the mistake: the runtime's torchrun left out
    done = run_python(*_argv(command, tmp_path)[1:], timeout=60, env=_trainjob_env(trainer, 0, 29400))
    assert done.returncode != 0, done.stdout
    assert "not started by torchrun" in done.stderr, done.stderr
    assert "PET_NNODES=2" in done.stderr
    assert not (tmp_path / "weights.pt").exists()
