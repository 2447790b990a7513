"""Runs every benchmark (each in its own process) and prints their ratios as one table.

Run: python benchmarks/run.py [--quick] [NAME ...]     (NAME: input, mirrored, overhead, ...)

The header names the host, the versions and the thread settings; each benchmark's own lines
follow as it runs, and a final table gathers every line that carries a ratio. A TensorFlow
reference runs where a benchmark supports one and PHALANX_TF_PYTHON (a python with
tensorflow-cpu installed, never a phalanx dependency) is set.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def header() -> str:
    """Host, versions and thread settings, so a table is never read without its machine."""
    import torch

    import phalanx

    tf_python = os.environ.get("PHALANX_TF_PYTHON")
    tf = "not set (PHALANX_TF_PYTHON)"
    if tf_python:
        done = subprocess.run(
            [tf_python, "-c", "import tensorflow as tf; print(tf.__version__)"],
            capture_output=True,
            text=True,
        )
        tf = done.stdout.strip() or f"{tf_python} cannot import tensorflow"
    system = f"{platform.system()} {platform.release()}"
    host = f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, {system})"
    versions = f"python {platform.python_version()}, torch {torch.__version__}, phalanx {phalanx.__version__}"
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    lines = [
        f"host      {host}",
        f"versions  {versions}, tensorflow {tf}",
        f"threads   torch intra-op {torch.get_num_threads()}, OMP_NUM_THREADS={threads} "
        "(each benchmark sets its own)",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    parser.add_argument("only", nargs="*", help="benchmark names (bench_<name>.py); default all")
    args = parser.parse_args()
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.only]
    print(header(), flush=True)
    failed, table = [], []
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr[-4000:] if done.returncode else "")
        if done.returncode:
            failed.append(script.stem)
        table += [
            f"{script.stem.removeprefix('bench_'):<12} {line.strip()}"
            for line in done.stdout.splitlines()
            if "ratio" in line
        ]
    print("\n== summary (ratio > 1 in 'speed ratio' means phalanx is faster)")
    print("\n".join(table) if table else "(no ratios printed)")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
