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
