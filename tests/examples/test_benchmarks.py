"""The benchmarks run and print their ratios (no timing thresholds: performance is measured, not asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cluster import run_python

pytestmark = pytest.mark.multiprocess

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_benchmark_runner_prints_ratios():
    # the runner's smallest run of its three cheapest benchmarks (--quick, ~5 s each): its
    # header, each one's own lines, and the summary gathering every ratio line under its name
    done = run_python(BENCHMARKS / "run.py", "--quick", "overhead", "ps", "mirrored", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "ps read 4MB" in done.stdout
    assert "per-run overhead" in done.stdout
    assert "2 CPU replicas" in done.stdout  # bench_mirrored
    header = done.stdout.split("== bench_")[0]
    assert "torch 2." in header
    assert "CPUs" in header
    runs, summary = done.stdout.split("== summary")
    ratio_lines = [line.strip() for line in runs.splitlines() if "ratio" in line]
    assert len(ratio_lines) >= 6
    assert [line.split(maxsplit=1)[1] for line in summary.splitlines()[1:]] == ratio_lines
    assert {line.split(maxsplit=1)[0] for line in summary.splitlines()[1:]} == {"overhead", "ps", "mirrored"}


def test_input_benchmark_compares_with_dataloader():
    done = run_python(BENCHMARKS / "bench_input.py", "--quick", timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("   DataLoader ") == 2  # the two comparisons with a plain DataLoader
    # 2 DataLoader workers map each element once in all (the benchmark also exits non-zero otherwise)
    assert "0 workers 4096, 2 workers 4096 " in done.stdout


def test_scaling_benchmark_compares_both_transports_with_ddp(tmp_path):
    plot = tmp_path / "scaling.png"
    args = ("--quick", "--workers", "2", "--plot", plot)
    done = run_python(BENCHMARKS / "bench_scaling.py", *args, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 workers, shared memory" in done.stdout
    assert "2 workers, gloo" in done.stdout
    assert plot.stat().st_size > 0


def test_multiworker_benchmark_times_the_users_loops_against_ddp():
    # section 2 only: the custom loop and fit, in rounds of 30 and 100 steps, each against DDP
    done = run_python(BENCHMARKS / "bench_multiworker.py", "--quick", "--section", "2", timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    for loop in ("custom loop", "fit        "):
        for steps in (" 30", "100"):
            assert f"user's {loop} {steps}-step rounds" in done.stdout
    assert done.stdout.count("CPU ms/step of worker 0") == 4
