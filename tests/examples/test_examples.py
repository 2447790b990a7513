"""Every example runs, start to end, as a user would run it (smoke tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cluster import run_python

pytestmark = pytest.mark.multiprocess  # every example runs in processes of its own

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("script", "args", "expect"),
    [
        ("keras_guide.py", ["--epochs", "1"], "evaluate:"),
        ("custom_training_loop.py", ["--epochs", "2"], "Epoch 2, Loss:"),
        ("keras_multi_device_digits.py", ["--epochs", "3"], "test accuracy"),
    ],
)
def test_example_runs(script, args, expect, tmp_path):
    extra = ["--checkpoint-dir", str(tmp_path)] if "digits" in script else []
    done = run_python(EXAMPLES / script, *args, *extra, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert expect in done.stdout


def test_multi_worker_example_under_the_launcher(tmp_path):
    script = EXAMPLES / "multi_worker_keras.py"
    done = run_python(
        "-m", "phalanx", "launch", "--workers", 2, script, "--epochs", 2, "--model-dir", tmp_path, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[worker-0] saved True" in done.stdout
    restored = float(done.stdout.split("[worker-0] restored model accuracy: ")[1].split()[0])
    assert restored > 0.5  # load_model rebuilt the nn.Sequential without its class
    assert "Epoch 2/2" in done.stdout
    assert (tmp_path / "model.pt").exists()
    assert not (tmp_path / "backup").exists()


def test_parameter_server_example_under_the_launcher():
    launch = ["-m", "phalanx", "launch", "--chief", "--workers", 2, "--ps", 1]
    done = run_python(*launch, EXAMPLES / "parameter_server_training.py", "--epochs", 3, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[chief-0] Epoch 3:" in done.stdout
    accuracy = float(done.stdout.split("final accuracy on all digits: ")[1].split()[0])
    assert accuracy > 0.8


def test_estimator_example_trains_and_evaluates_locally(tmp_path):
    # Its cluster roles run in tests/multiprocess/test_estimator_cluster.py; the TF1 cluster
    # examples (tf1_server.py, tf1_client.py, tf1_between_graph.py) in test_tf1_cluster.py.
    script = EXAMPLES / "estimator_train_and_evaluate.py"
    done = run_python(
        script, "--max-steps", 100, "--model-dir", tmp_path / "model", timeout=240, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "local done; evaluation:" in done.stdout
    assert "at global step 100" in done.stdout


def test_model_parallel_example_splits_the_model_over_two_workers(tmp_path):
    script = EXAMPLES / "model_parallel.py"
    done = run_python(
        "-m", "phalanx", "launch", "--workers", 2, script, "--steps", 10, timeout=240, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[worker-1] worker 1: wq (64, 64), held here (32, 64)" in done.stdout
    final = float(done.stdout.split("[worker-0] final loss ")[1].split()[0])
    first = float(done.stdout.split("[worker-0] step 0: loss ")[1].split()[0])
    assert final < first  # it learns
