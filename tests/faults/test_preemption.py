"""PreemptionCheckpointHandler across two MultiWorkerMirrored workers started by hand with
TF_CONFIG: a termination notice to one worker mid-training makes both save at the same step and
exit; the restarted job ends with the uninterrupted run's weights; an error on one worker is
named on the other."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint.failure_handling.handler import STATE_FILE
from support.cluster import LocalCluster, run_cluster

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent / "scripts" / "preemption_loop.py"
STEPS = 150  # the script's
PAUSE = 0.05  # seconds after each step of an interrupted run: 6 s of training after PROGRESS, more
# than the grace period (3 s) the grace test trains on for
GRACE = 60.0  # the "platform's" grace period: both workers must have saved and exited within it
PROGRESS = 30  # worker-1 has done this many steps when it is interrupted


def _wait_for_progress(folder: Path, steps: int, cluster: LocalCluster) -> None:
    progress = folder / "progress-1"
    deadline = time.monotonic() + 120
    while not (progress.exists() and progress.read_text() and int(progress.read_text()) >= steps):
        if time.monotonic() > deadline:
            raise AssertionError(f"worker-1 did not reach step {steps} within 120 s")
        if any(cluster._tasks[n].proc.poll() is not None for n in cluster.names):
            raise AssertionError(f"a task ended before step {steps}: {cluster.wait(10).output}")
        time.sleep(0.05)


def _run(folder: Path, mode: str, pause: float = 0.0, **env: str):
    folder.mkdir(exist_ok=True)
    args = (folder / "ckpt", folder / "final.pt", mode, pause)
    return run_cluster(SCRIPT, *args, workers=2, timeout=180, env=env or None)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    _run(folder, "sigterm").check()
    return torch.load(folder / "final.pt")


def _interrupt(folder: Path, mode: str, interrupt) -> tuple:
    folder.mkdir()
    with LocalCluster(2) as cluster:
        cluster.start(SCRIPT, folder / "ckpt", folder / "final.pt", mode, PAUSE)
        _wait_for_progress(folder, PROGRESS, cluster)
        interrupt(cluster)
        return cluster.wait(GRACE)  # ClusterTimeout unless both exited within the grace period


def _saved_steps(run) -> list[int]:
    """The run calls after which each worker saved, checked to be the same on both."""
    found = re.findall(r"\[(worker-\d)\].*saved a checkpoint after (\d+) run calls\.", run.output)
    saves = {name: [int(n) for task, n in found if task == name] for name in ("worker-0", "worker-1")}
    assert saves["worker-0"], run.output
    assert saves["worker-0"] == saves["worker-1"], run.output  # the same steps on both
    return saves["worker-0"]


def _saved_step(run) -> int:
    (step,) = _saved_steps(run)
    return step


def _resume_and_compare(folder: Path, step: int, expected: dict, mode: str) -> None:
    state = json.loads((folder / "ckpt" / STATE_FILE).read_text())
    assert state["total_run_calls"] == step
    assert PROGRESS <= step < STEPS  # mid-training: neither at the start nor after the end
    resumed = _run(folder, mode).check()
    assert f"[worker-0] starting at run call {step}" in resumed.output
    assert f"[worker-1] starting at run call {step}" in resumed.output
    got = torch.load(folder / "final.pt")
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=key)


def test_sigterm_to_one_worker_saves_both_at_one_step_and_the_restart_matches(tmp_path, uninterrupted):
    run = _interrupt(tmp_path / "run", "sigterm", lambda c: os.kill(c.pid("worker-1"), signal.SIGTERM))
    assert run.returncodes == {"worker-0": 42, "worker-1": 42}, run.output  # TF's restart code
    assert "received SIGTERM: saving a checkpoint with every worker" in run["worker-1"].output
    _resume_and_compare(tmp_path / "run", _saved_step(run), uninterrupted, "sigterm")


def test_a_handler_made_after_the_scope_block_saves_and_resumes_as_one_made_inside(tmp_path, uninterrupted):
    run = _interrupt(tmp_path / "run", "outside", lambda c: os.kill(c.pid("worker-1"), signal.SIGTERM))
    assert run.returncodes == {"worker-0": 42, "worker-1": 42}, run.output
    assert "received SIGTERM: saving a checkpoint with every worker" in run["worker-1"].output
    _resume_and_compare(tmp_path / "run", _saved_step(run), uninterrupted, "outside")


def test_with_a_grace_period_both_save_at_once_train_on_and_save_again(tmp_path, uninterrupted):
    run = _interrupt(tmp_path / "run", "grace", lambda c: os.kill(c.pid("worker-1"), signal.SIGTERM))
    assert run.returncodes == {"worker-0": 42, "worker-1": 42}, run.output
    first, last = _saved_steps(run)  # worker-1's time, running out, ends it on both
    assert first < last, run.output
    _resume_and_compare(tmp_path / "run", last, uninterrupted, "grace")


def test_a_termination_watcher_fn_notice_does_the_same(tmp_path, uninterrupted):
    run = _interrupt(tmp_path / "run", "watcher", lambda c: (tmp_path / "run" / "notice").touch())
    assert run.returncodes == {"worker-0": 42, "worker-1": 42}, run.output
    assert "its termination_watcher_fn returned True" in run["worker-1"].output
    (tmp_path / "run" / "notice").unlink()
    _resume_and_compare(tmp_path / "run", _saved_step(run), uninterrupted, "watcher")


def test_an_error_on_one_worker_is_named_on_the_other(tmp_path):
    run = _run(tmp_path / "run", "error")
    assert run["worker-1"].returncode != 0
    assert "ValueError: bad batch 40" in run["worker-1"].output
    assert run["worker-0"].returncode != 0
    named = r"PeerFailedError: worker:1 \S+ raised ValueError: bad batch 40"
    assert re.search(named, run["worker-0"].output), run.output
    # told through the store and interrupted at once, not left waiting for the stall bound
    assert "CollectiveMismatchError" not in run["worker-0"].output, run.output


FIT = Path(__file__).parent / "scripts" / "fit_preempted.py"


def test_fit_with_backup_and_restore_saves_before_preemption_and_resumes_exactly(tmp_path):
    def fit(folder: Path, pause: float):
        folder.mkdir(exist_ok=True)
        return run_cluster(FIT, folder / "backup", folder / "final.pt", pause, workers=2, timeout=180)

    fit(tmp_path / "reference", 0.0).check()
    folder = tmp_path / "run"
    folder.mkdir()
    with LocalCluster(2) as cluster:
        cluster.start(FIT, folder / "backup", folder / "final.pt", PAUSE)
        _wait_for_progress(folder, PROGRESS, cluster)  # some batch of epoch 6 or later, of 15
        os.kill(cluster.pid("worker-1"), signal.SIGTERM)
        run = cluster.wait(GRACE)
    assert run.returncodes == {"worker-0": 42, "worker-1": 42}, run.output
    assert "received SIGTERM: saving a checkpoint with every worker" in run["worker-1"].output
    exits = re.findall(r"saved a backup after batch (\d+) of epoch (\d+) and exits", run.output)
    assert len(exits) == 2, run.output
    assert exits[0] == exits[1], run.output  # the same batch on both workers
    assert (folder / "backup" / "backup.pt").exists()
    assert not (folder / "final.pt").exists()
    fit(folder, 0.0).check()
    expected, got = torch.load(tmp_path / "reference" / "final.pt"), torch.load(folder / "final.pt")
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=key)
