#!/usr/bin/env bash
# Installs phalanx with its test extras into ./.venv and runs ruff, mypy and the test suite.
# torch is pinned to the CPU build so that a fresh machine never pulls a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,models]"  # models: transformers for tests/models
ruff check src tests benchmarks examples
mypy
python -m pytest -q "$@"
