"""The test support itself: local clusters of real processes and the per-test hygiene."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import pytest

from support.cluster import ClusterTimeout, LocalCluster, run_cluster, run_python
from support.preloaded import Preloaded

pytestmark = pytest.mark.multiprocess
TESTS = Path(__file__).resolve().parents[1]

REPORT = """\
import json, os, sys, time
config = json.loads(os.environ["TF_CONFIG"])
print(json.dumps({"task": config["task"], "cluster": config["cluster"], "argv": sys.argv[1:],
                  "env": {k: os.environ.get(k) for k in sys.argv[2:]}}))
task = f"{config['task']['type']}-{config['task']['index']}"
if task in sys.argv[1].split(","):  # these tasks hang
    time.sleep(300)
"""


@pytest.fixture
def report(tmp_path):
    path = tmp_path / "report.py"
    path.write_text(REPORT)
    return path


def _reports(run):
    return {name: json.loads(task.output.splitlines()[0]) for name, task in run.tasks.items()}


def test_every_task_gets_its_tf_config_and_the_same_clean_environment(report, monkeypatch):
    monkeypatch.setenv("RANK", "5")  # never inherited: the tasks are configured by TF_CONFIG alone
    names = ["RANK", "PHALANX_CLUSTER_TOKEN", "PHALANX_JOIN_TIMEOUT_SECONDS", "PYTHONPATH", "EXTRA"]
    run = run_cluster(report, "none", *names, workers=2, chief=True, env={"EXTRA": "x"}, timeout=60)
    assert run.check().returncodes == {"chief-0": 0, "worker-0": 0, "worker-1": 0}
    reports = _reports(run)
    assert [r["task"] for r in reports.values()] == [
        {"type": "chief", "index": 0},
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
    ]
    cluster = reports["chief-0"]["cluster"]
    ports = [address.rsplit(":", 1)[1] for job in ("chief", "worker") for address in cluster[job]]
    assert len(set(ports)) == 3
    envs = [r["env"] for r in reports.values()]
    assert all(env == envs[0] for env in envs)  # one token for the whole cluster
    assert envs[0]["RANK"] is None
    assert envs[0]["PHALANX_CLUSTER_TOKEN"]
    assert envs[0]["PHALANX_JOIN_TIMEOUT_SECONDS"] == "60.0"
    assert envs[0]["PYTHONPATH"].split(os.pathsep)[:2] == [str(TESTS), str(TESTS.parent / "src")]
    assert envs[0]["EXTRA"] == "x"
    assert '[worker-1] {"task": {"type": "worker", "index": 1}' in run.output  # prefixed, kept in order


def test_a_hung_task_is_killed_and_named_after_the_timeout(report):
    with LocalCluster(2) as cluster:
        cluster.start(report, "worker-1")
        with pytest.raises(ClusterTimeout, match=r"timed out after 3s; still running: \['worker-1'\]"):
            cluster.wait(timeout=3)
        with pytest.raises(ProcessLookupError):
            os.kill(cluster.pid("worker-1"), 0)  # killed and reaped


def test_the_tasks_of_a_parameter_server_cluster_are_stopped_when_the_chief_ends(report):
    run = run_cluster(report, "worker-0,worker-1,ps-0", workers=2, chief=True, ps=1, timeout=60)
    assert run.returncodes == {
        "chief-0": 0,
        "worker-0": -signal.SIGKILL,
        "worker-1": -signal.SIGKILL,
        "ps-0": -signal.SIGKILL,
    }
    run.check()  # the chief alone
    with pytest.raises(AssertionError, match="tasks failed: {'ps-0': -9}"):
        run.check("ps-0")


def test_one_python_process_times_out_with_its_output():
    with pytest.raises(ClusterTimeout, match="timed out after 2s; it was killed.\nstarted"):
        run_python("-c", "import time; print('started', flush=True); time.sleep(300)", timeout=2)


def test_a_preloaded_child_runs_a_script_as_python_would_and_times_out_with_its_output(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys, time\n"
        "print(__name__, sys.argv[1:], os.getcwd(), sys.path[0], 'torch' in sys.modules)\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'hang':\n"
        "    time.sleep(300)\n"
        "raise SystemExit(int(sys.argv[1]))\n"
    )
    with Preloaded() as python:
        done = python.run(script, 3, cwd=tmp_path, timeout=60)
        assert done.returncode == 3
        assert done.stdout == f"__main__ ['3'] {tmp_path} {tmp_path} True\n"  # torch: imported once
        assert done.stderr == "to stderr\n"
        with pytest.raises(AssertionError, match=r"timed out after 1s; it was killed \(and whatever"):
            python.run(script, "hang", cwd=tmp_path, timeout=1)
        assert python.run(script, 0, cwd=tmp_path, timeout=60).returncode == 0  # it serves on
        os.kill(python._proc.pid, signal.SIGKILL)
        python._proc.wait()
        with pytest.raises(AssertionError, match=r"server is gone \(exit code -9\); it was running"):
            python.run(script, 0, cwd=tmp_path, timeout=60)


@pytest.fixture
def inner(pytester):
    """A pytest session inside this one, with tests/conftest.py's hygiene."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    multiprocess: starts processes\n")
    return pytester


def test_a_child_process_left_alive_fails_the_test_naming_it(inner):
    inner.makepyfile(
        textwrap.dedent(
            """
            import subprocess, pytest

            @pytest.mark.multiprocess
            def test_leaks():
                subprocess.Popen(["sleep", "117"])
            """
        )
    )
    result = inner.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*child processes outlived the test: {*: 'sleep 117 '}*"])


def test_environment_variables_are_restored_after_each_test(inner):
    inner.makepyfile(
        textwrap.dedent(
            """
            import os

            def test_sets():
                os.environ["PHALANX_TEST_LEFTOVER"] = "1"

            def test_sees_nothing():
                assert "PHALANX_TEST_LEFTOVER" not in os.environ
            """
        )
    )
    inner.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)
    assert "PHALANX_TEST_LEFTOVER" not in os.environ
