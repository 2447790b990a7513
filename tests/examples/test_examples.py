"""Every example runs, start to end, as a user would run it (smoke tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args, *extra],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert expect in done.stdout
