"""The benchmarks run and print their ratios (no timing thresholds: performance is measured, not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_benchmark_runner_prints_ratios():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run.py"), "--quick", "overhead", "mirrored", "ps"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ratio") >= 6
    assert "ps read 4MB" in done.stdout
    assert "per-run overhead" in done.stdout
