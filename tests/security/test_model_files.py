"""Crafted model files: load_model refuses them before anything named in them is imported or run.

A model file is read with ``torch.load(weights_only=True)`` (no pickle code), and its
architecture is data that `phalanx.keras.architecture.build` turns into allow-listed
``torch.nn`` classes only. Each test below hands load_model a hostile file and proves that
no module was imported, no process started and no command run.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

import phalanx
from phalanx.keras.architecture import ArchitectureError


@pytest.fixture
def saved(tmp_path):
    """A legitimate Sequential model file, loaded once so that load_model's own imports are done."""
    path = str(tmp_path / "model.pt")
    phalanx.Model(nn.Sequential(nn.Linear(4, 3), nn.ReLU())).save(path)
    phalanx.load_model(path)
    return path


@pytest.fixture
def watch(monkeypatch, tmp_path):
    """Records every os.system / subprocess.Popen / os.execv call and every new module."""
    calls = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(("os.system", a)) or 0)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: calls.append(("Popen", a)))
    monkeypatch.setattr(os, "execv", lambda *a, **k: calls.append(("execv", a)))
    before = set(sys.modules)

    def report():
        return calls, sorted(set(sys.modules) - before)

    return report


def _craft(path, **changes):
    payload = torch.load(path, weights_only=True)
    payload.update(changes)
    torch.save(payload, path)
    return path


HOSTILE_TYPES = [
    "os.system",
    "system",
    "subprocess.Popen",
    "builtins.eval",
    "__import__",
    "Module",
    "MultiheadAttention",
    "TransformerEncoderLayer",
    "torch.nn.Linear",
    "phalanx.nn.SyncBatchNorm",
]


@pytest.mark.parametrize("class_name", HOSTILE_TYPES)
def test_a_type_outside_the_allow_list_is_refused_and_nothing_runs(saved, watch, class_name):
    node = {"class_name": class_name, "config": {"command": "touch /tmp/phalanx-pwned"}}
    _craft(saved, architecture={"class_name": "Sequential", "children": [("0", node)]})
    with pytest.raises(ArchitectureError, match="only allow-listed torch.nn layers") as error:
        phalanx.load_model(saved)
    assert "HINT: build the module yourself and pass it" in str(error.value)
    assert watch() == ([], [])


@pytest.mark.parametrize(
    "config",
    [
        {"in_features": 4, "out_features": 3, "device": "cuda:7"},  # not an architecture argument
        {"in_features": 4, "out_features": 3, "__class__": "os.system"},
        {"in_features": 4, "out_features": 3, "_weight": None},
        {"in_features": 4, "out_features": [1, {"nested": "dict"}]},  # not plain data
    ],
)
def test_arguments_must_be_constructor_parameters_with_plain_values(saved, watch, config):
    _craft(saved, architecture={"class_name": "Linear", "config": config})
    with pytest.raises(ArchitectureError, match="Linear's arguments are"):
        phalanx.load_model(saved)
    assert watch() == ([], [])


@pytest.mark.parametrize(
    "architecture",
    [
        "os.system",
        {"class_name": "Sequential", "children": "os.system"},
        {"class_name": "Sequential", "children": [(0, {"class_name": "ReLU", "config": {}})]},
        {"class_name": "Linear", "config": "in_features=4"},
    ],
)
def test_malformed_architectures_are_refused(saved, watch, architecture):
    _craft(saved, architecture=architecture)
    with pytest.raises(ArchitectureError):
        phalanx.load_model(saved)
    assert watch() == ([], [])


def test_a_module_class_naming_a_function_is_not_called(saved, watch):
    _craft(saved, architecture=None, module_class="os:system", module_config={"command": "touch x"})
    with pytest.raises(ValueError, match="HINT: pass the module"):
        phalanx.load_model(saved)
    assert watch() == ([], [])


def test_a_module_class_in_an_unimported_module_is_not_imported(saved, watch):
    # a standard-library server module this process has not imported (earlier tests may have)
    candidates = ("xmlrpc.server", "wsgiref.simple_server", "imaplib")
    unimported = next(m for m in candidates if m not in sys.modules)
    _craft(saved, architecture=None, module_class=f"{unimported}:Server")
    with pytest.raises(ValueError, match="never imports code named by a file"):
        phalanx.load_model(saved)
    calls, new_modules = watch()
    assert calls == []
    assert unimported not in new_modules
    assert unimported not in sys.modules


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_is_never_unpickled(tmp_path, request):
    marker = tmp_path / "pwned"
    path = str(tmp_path / "evil.pt")
    # Written before os.system is watched (pickling the exploit needs the real function).
    torch.save({"format": "phalanx.model/1", "weights": _Exploit(marker)}, path)
    watch = request.getfixturevalue("watch")
    with pytest.raises(pickle.UnpicklingError):
        phalanx.load_model(path)
    assert not marker.exists()
    assert watch() == ([], [])


def test_the_real_os_system_is_not_reached_either(tmp_path):
    # Without monkeypatching: a fresh interpreter loads a crafted file that would create a file.
    marker = tmp_path / "created-by-the-file"
    path = str(tmp_path / "m.pt")
    phalanx.Model(nn.Sequential(nn.Linear(2, 2))).save(path)
    node = {"class_name": "system", "config": {"command": f"touch {marker}"}}
    _craft(path, architecture=node, module_class="os:system", module_config={"command": f"touch {marker}"})
    code = (
        "import sys, phalanx\n"
        "try:\n    phalanx.load_model(sys.argv[1])\n"
        "except ValueError as exc:\n    print('refused:', type(exc).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: ArchitectureError" in done.stdout
    assert not marker.exists()
