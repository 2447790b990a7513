"""Runs every benchmark (each in its own process) and prints one line per case with its ratio.

Run: python benchmarks/run.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    parser.add_argument("only", nargs="*", help="benchmark names (bench_<name>.py); default all")
    args = parser.parse_args()
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.only]
    failed = 0
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        failed += subprocess.call(cmd, cwd=HERE) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
