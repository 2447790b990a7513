"""`phalanx launch` with real processes: TF_CONFIG per task, prefixes, failures, timeouts."""

from __future__ import annotations

import importlib
import io
import json
import time
from pathlib import Path

import pytest

from phalanx.cluster import launch, launch_node
from support.cluster import free_ports, run_python

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"
TASK = SCRIPTS / "launcher_task.py"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait() is missing


@pytest.mark.timeout(60)
def test_every_task_gets_its_tf_config_torchrun_variables_and_prefix():
    out = io.StringIO()
    assert launch(TASK, workers=2, ps=1, chief=True, args=["ok"], out=out, timeout=30) == 0
    lines = out.getvalue().splitlines()
    chief = next(line for line in lines if line.startswith("[chief-0] task chief:0"))
    master = chief.rsplit("master=", 1)[1]
    assert chief == f"[chief-0] task chief:0 rank=0 world=3 local=0/3 master={master}"
    assert f"[worker-1] task worker:1 rank=2 world=3 local=2/3 master={master}" in lines
    assert "[ps-0] task ps:0 rank=None world=None local=None/None master=None:None" in lines
    # chief + ps: a parameter-server cluster, which ends with the chief
    assert "[phalanx launch] the chief finished; stopping ['ps-0']." in lines


@pytest.mark.timeout(60)
def test_a_failing_task_stops_the_others_quickly_and_leaves_no_process(tmp_path):
    out = io.StringIO()
    start = time.monotonic()
    assert launch(TASK, workers=2, ps=1, args=["fail", tmp_path], out=out, timeout=30) == 3
    assert time.monotonic() - start < 10
    assert "[phalanx launch] worker-1 exited with code 3; stopping the other tasks." in out.getvalue()
    sleeper, grandchild = map(int, (tmp_path / "pids").read_text().split())
    deadline = time.monotonic() + 5
    while (_alive(sleeper) or _alive(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(sleeper)
    assert not _alive(grandchild)  # in the task's process group, so stopped with it


@pytest.mark.timeout(60)
def test_timeout_stops_everything_and_names_the_tasks_still_running():
    out = io.StringIO()
    start = time.monotonic()
    assert launch(TASK, workers=1, args=["sleep"], out=out, timeout=1) == 124
    assert time.monotonic() - start < 8
    assert "timed out after 1s; still running: ['worker-0']. Stopping them." in out.getvalue()


@pytest.mark.timeout(60)
def test_stdout_and_stderr_stay_apart(capsys):
    assert launch(TASK, workers=1, args=["streams"], timeout=30) == 0
    captured = capsys.readouterr()
    assert "[worker-0] task worker:0" in captured.out
    assert "[worker-0] to stderr\n" in captured.err
    assert "to stderr" not in captured.out


@pytest.mark.timeout(60)
def test_a_module_level_function_runs_in_every_task(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    functions = importlib.import_module("launcher_functions")
    out = io.StringIO()
    assert launch(functions.report, workers=2, args=["hello", 0], out=out, timeout=30) == 0
    assert "[worker-1] hello from worker:1" in out.getvalue()
    assert launch(functions.report, workers=2, args=["bye", 7], out=io.StringIO(), timeout=30) == 7


@pytest.mark.timeout(60)
def test_a_function_of_the_main_script_runs_without_rerunning_its_main_block():
    done = run_python(SCRIPTS / "launcher_main_function.py", timeout=50)
    assert done.returncode == 0, done.stderr
    assert "[worker-1] it ran as __mp_main__" in done.stdout


@pytest.mark.timeout(60)
def test_the_cli_with_torchruns_spelling():
    done = run_python("-m", "phalanx", "launch", "--nproc-per-node", "2", TASK, "ok", timeout=50)
    assert done.returncode == 0, done.stderr
    assert "[worker-1] task worker:1 rank=1 world=2 local=1/2" in done.stdout


@pytest.mark.timeout(60)
def test_per_node_mode_starts_only_this_nodes_tasks():
    a, b, c = free_ports(3)
    cluster = {"worker": [f"otherhost:{c}", f"127.0.0.1:{a}", f"127.0.0.1:{b}"]}
    out = io.StringIO()
    code = launch_node(
        TASK, json.dumps({"cluster": cluster}), node_tasks="127.0.0.1", args=["ok"], out=out, timeout=30
    )
    assert code == 0
    text = out.getvalue()
    assert f"[worker-2] task worker:2 rank=2 world=3 local=1/2 master=otherhost:{c}" in text
    assert "worker-0" not in text
    out = io.StringIO()
    assert launch_node(TASK, cluster, node_tasks=[("worker", 0)], args=["ok"], out=out, timeout=30) == 0
    assert "[worker-0] task worker:0 rank=0 world=3 local=0/1" in out.getvalue()
