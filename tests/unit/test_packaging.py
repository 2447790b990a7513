"""What ``pip install phalanx`` gets: the wheel's files and its requirements.

The wheel is built from a copy of the sources (no build directories in the checkout), with the
setuptools of this environment, and read as pip would install it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# What a CPU user installs, and why: torch; numpy (arrays in, AUC, splitting); tqdm (fit's
# progress bar); the parameter server's gRPC transport and pickling; its TLS certificates.
RUNTIME = {"torch", "numpy", "tqdm", "grpcio", "cloudpickle", "cryptography"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = source / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
        + ["."],
        cwd=source,
        check=True,
        timeout=240,
    )
    (built,) = out.glob("phalanx-*.whl")
    return zipfile.ZipFile(built)


def _metadata(wheel: zipfile.ZipFile):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return Parser().parsestr(wheel.read(name).decode())


def test_the_wheel_ships_py_typed(wheel):
    assert "phalanx/py.typed" in wheel.namelist()


def test_a_plain_install_pulls_only_what_training_the_ps_and_security_need(wheel):
    requirements = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist")]
    plain = {r.name for r in requirements if r.marker is None}
    assert plain == RUNTIME
    extras = {r.name: r for r in requirements if r.marker is not None}
    assert "torchmetrics" in extras  # optional, never plain
    assert "transformers" in extras
    assert "safetensors" in extras  # safetensors files (phalanx.checkpoint.weights)


def test_no_requirement_a_user_installs_is_pinned_exactly(wheel):
    for text in _metadata(wheel).get_all("Requires-Dist"):
        assert "==" not in str(Requirement(text).specifier), text  # pins live in the constraints file


def test_the_torch_range_is_the_torch_ci_tests(wheel):
    requirements = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist")]
    (torch_req,) = [r for r in requirements if r.name == "torch"]
    constraints = (ROOT / "scripts" / "test-constraints.txt").read_text()
    tested = Version(re.search(r"^torch==(\S+)$", constraints, re.M).group(1))
    assert torch_req.specifier.contains(tested)
    assert torch_req.specifier.contains(Version(torch.__version__).base_version)
    # nothing wider than the minor release CI tests
    assert not torch_req.specifier.contains(f"{tested.major}.{tested.minor - 1}.0")
    assert not torch_req.specifier.contains(f"{tested.major}.{tested.minor + 1}.0")
    readme = (ROOT / "README.md").read_text()
    assert f"torch {tested.major}.{tested.minor}" in readme


def test_the_test_script_installs_with_the_constraints_file():
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert script.count("-c scripts/test-constraints.txt") >= 2
    pins = (ROOT / "scripts" / "test-constraints.txt").read_text()
    assert re.search(r"^transformers==", pins, re.M)
