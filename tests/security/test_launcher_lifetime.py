"""No orphans: every task of `phalanx launch` dies with its launcher, however the launcher ends.

Real processes: ``phalanx launch --workers 2`` of a script that trains forever under
MultiWorkerMirroredStrategy. Each test checks by pid that no task remains, that the
cluster's ports are free again, and that nothing hung (every wait has a timeout).
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from phalanx.cluster._ports import free_ports
from phalanx.cluster._processes import GRACE_SECONDS
from phalanx.security.token import TOKEN_ENV, new_token
from security.helpers import SCRIPTS, alive, port_is_free, wait_for

pytestmark = pytest.mark.multiprocess
TRAIN_FOREVER = SCRIPTS / "train_forever.py"
PS_TASK = SCRIPTS / "ps_cluster_task.py"
START_SECONDS = 120  # two workers importing torch on a loaded machine
EXIT_SECONDS = GRACE_SECONDS + 10


def _training(out_dir):
    """The tasks' records once both train: [{"pid": ..., "ports": [...]}, ...]."""
    files = [out_dir / f"task-{rank}.json" for rank in (0, 1)]
    if all(f.exists() for f in files):
        return [json.loads(f.read_text()) for f in files]
    return None


def _start_training(launcher, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    launch = launcher(["--workers", "2", TRAIN_FOREVER, out_dir])
    tasks = wait_for(
        lambda: _training(out_dir) or launch.process.poll() is not None, START_SECONDS, "training"
    )
    assert tasks is not True, f"the launcher exited early:\n{launch.output()}"
    launch.pids += [t["pid"] for t in tasks]
    return launch, tasks, out_dir


def _nothing_left(tasks):
    pids = [t["pid"] for t in tasks]
    wait_for(lambda: not any(alive(p) for p in pids), EXIT_SECONDS, f"tasks {pids} to end")
    ports = sorted({p for t in tasks for p in t["ports"]})
    wait_for(lambda: all(port_is_free(p) for p in ports), EXIT_SECONDS, f"ports {ports} to be free")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_is_passed_on_and_it_exits_non_zero(launcher, tmp_path, sig):
    launch, tasks, out_dir = _start_training(launcher, tmp_path)
    launch.process.send_signal(sig)
    assert launch.wait(EXIT_SECONDS) == 128 + sig
    _nothing_left(tasks)
    for rank in (0, 1):  # each task got the launcher's signal itself, not only a SIGKILL
        assert (out_dir / f"got-{rank}.txt").read_text() == sig.name
    assert f"[phalanx launch] received {sig.name}; passing it on to" in launch.output()


@pytest.mark.timeout(300)
def test_a_killed_launcher_takes_its_tasks_with_it(launcher, tmp_path):
    launch, tasks, _ = _start_training(launcher, tmp_path)
    os.kill(launch.process.pid, signal.SIGKILL)
    assert launch.wait(EXIT_SECONDS) == -signal.SIGKILL
    _nothing_left(tasks)


def _ps_cluster(free_ports):
    chief, worker, ps = free_ports(3)
    return json.dumps(
        {"chief": [f"127.0.0.1:{chief}"], "worker": [f"127.0.0.1:{worker}"], "ps": [f"127.0.0.1:{ps}"]}
    ), [chief, worker, ps]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chief_code", [0, 3])
def test_per_node_mode_with_a_ps_cluster_ends_with_the_chief_and_reports_its_code(
    launcher, tmp_path, chief_code
):
    cluster, ports = _ps_cluster(free_ports)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["--tf-config", cluster, "--node", "127.0.0.1", PS_TASK, out_dir, chief_code]
    launch = launcher(args, env={TOKEN_ENV: new_token()})
    code = launch.wait(START_SECONDS)
    pids = [int((out_dir / f"{name}.pid").read_text()) for name in ("chief-0", "worker-0", "ps-0")]
    launch.pids += pids
    assert code == chief_code, launch.output()
    assert "[chief-0] chief done: [" in launch.output()
    if chief_code:
        assert "chief-0 exited with code 3; stopping the other tasks." in launch.output()
    else:
        assert "[phalanx launch] the chief finished; stopping ['ps-0', 'worker-0']." in launch.output()
    wait_for(lambda: not any(alive(p) for p in pids), EXIT_SECONDS, f"tasks {pids} to end")
    wait_for(lambda: all(port_is_free(p) for p in ports), EXIT_SECONDS, f"ports {ports} to be free")


@pytest.mark.timeout(60)
def test_per_node_mode_refuses_a_ps_cluster_without_a_token_before_starting_anything(launcher, tmp_path):
    cluster, _ = _ps_cluster(free_ports)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    launch = launcher(
        ["--tf-config", cluster, "--node", "127.0.0.1", PS_TASK, out_dir, 0], env=env, clean=True
    )
    assert launch.wait(50) == 2
    assert "PHALANX_CLUSTER_TOKEN is not set. HINT: " in launch.output()
    assert "export PHALANX_CLUSTER_TOKEN=<that value> on every node" in launch.output()
    assert list(out_dir.iterdir()) == []  # no task started
