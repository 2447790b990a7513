"""The ported TF programs that the guides quote as fragments run end to end under the launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_parameter_server_keras_example_with_its_sidecar_evaluator(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx",
            "launch",
            "--chief",
            "--workers",
            "2",
            "--ps",
            "1",
            str(EXAMPLES / "parameter_server_keras.py"),
            "--epochs",
            "3",
            "--checkpoint-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[chief-0] Epoch 3/3" in done.stdout
    accuracy = float(done.stdout.split("inline evaluation: accuracy ")[1].split()[0])
    assert accuracy > 0.8
    evaluated = int(done.stdout.split("sidecar evaluated ")[1].split()[0])
    assert evaluated >= 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-"))  # the chief's checkpoints


def test_performance_tips_example():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "performance_tips.py")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "converted: SyncBatchNorm" in done.stdout
    assert "mixed precision: computed in torch.bfloat16" in done.stdout
    assert "jit_compile: loss" in done.stdout


def _run_example(name, *args, cwd=None):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_distributed_input_guide_runs_every_cell():
    out = _run_example("distributed_input.py")
    assert "distributed input guide: all 12 cells ran" in out
    assert "1) LogicalDevice(name='/device:CPU:1', device_type='CPU')" in out
    # get_next_as_optional: 9 elements in global batches of 4 over 2 replicas, then no value
    assert "(tensor([0, 1]), tensor([2, 3]))\n(tensor([4, 5]), tensor([6, 7]))\n(tensor([8])," in out
    assert "element_spec: PerReplicaSpec(value_specs=((TensorSpec(shape=(None, 1)" in out
    # the StringLookup cell: "a", "c", "e" -> 1, 3, 0 (out of vocabulary), 2 per replica
    assert "0: tensor([1, 3]),\n  1: tensor([0, 1])" in out
    # the order of the outputs: every index i maps to 2 * i
    assert "np.int64(23): np.int64(46)}" in out


def test_custom_training_tutorial_trains_saves_and_restores_without_the_strategy(tmp_path):
    out = _run_example(
        "custom_training.py", "--epochs", 2, "--checkpoint-dir", tmp_path / "ckpt", cwd=tmp_path
    )
    assert "Number of devices: 2" in out
    epochs = [line for line in out.splitlines() if line.startswith("Epoch ")]
    assert len(epochs) == 6
    # epoch 1 was checkpointed after its test loop: the restored model scores its test accuracy
    first_test = float(epochs[0].split("Test Accuracy: ")[1])
    restored = float(out.split("without strategy: ")[1].split()[0])
    assert abs(restored - first_test) < 1e-3
    final_accuracy = float(epochs[-1].split("Accuracy: ")[1])
    assert final_accuracy > 80.0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint.json", "ckpt-1.pt"]
