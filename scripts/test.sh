#!/usr/bin/env bash
# Installs phalanx with its test extras into ./.venv and runs ruff, mypy and the test suite.
# torch is pinned to the CPU build so that a fresh machine never pulls a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip "setuptools>=77"  # tests/unit/test_packaging.py builds the wheel without isolation
# The versions CI tests (torch, and test-only pins such as transformers) are in one constraints file.
python -m pip install -q -c scripts/test-constraints.txt torch
python -m pip install -q -c scripts/test-constraints.txt -e ".[test,models]"  # models: transformers
# Headless Chromium reads the live status page in the suite (Debian's package; skipped without it).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "chromium could not be installed: the status page's browser test will skip"
fi
ruff check src tests benchmarks examples
mypy
python -m pytest -q "$@"
