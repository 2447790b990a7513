"""`phalanx demo` trains to > 90% test accuracy under every strategy it offers."""

from __future__ import annotations

import pytest

from phalanx.demo import STRATEGIES, run_demo
from support.cluster import run_python

pytestmark = pytest.mark.multiprocess  # the command-line tests start processes


def test_demo_default_reaches_90_percent():
    assert run_demo(verbose=0) > 0.9


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - {"multi_worker_mirrored"}))
def test_demo_runs_under_every_strategy(name):
    assert run_demo(name, epochs=2, verbose=0) > 0.2


def test_cli_entry_point_prints_progress_and_accuracy():
    done = run_python("-m", "phalanx", "demo", "--epochs", 1, "--strategy", "one_device", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Epoch 1/1" in done.stdout
    assert "test accuracy:" in done.stdout


def test_cli_rejects_unknown_strategy():
    done = run_python("-m", "phalanx", "demo", "--strategy", "nope", timeout=60)
    assert done.returncode == 2
    assert "invalid choice" in done.stderr


def test_cli_multi_worker_demo_launches_two_workers():
    demo = ["-m", "phalanx", "demo", "--strategy", "multi_worker_mirrored", "--epochs", 2]
    done = run_python(*demo, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[worker-0] test accuracy:" in done.stdout
    assert "[worker-1] test accuracy:" not in done.stdout  # logs only from the chief
