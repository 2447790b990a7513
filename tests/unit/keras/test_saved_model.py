"""phalanx.saved_model: a torch.export artifact that serves without the model's class."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import phalanx
from phalanx import saved_model

TRAINER = textwrap.dedent(
    """
    import sys, torch, phalanx
    from my_model_package import Net  # the class lives only in the training code

    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(0)
        model = phalanx.Model(Net())
    path = phalanx.saved_model.save(model, sys.argv[1], torch.randn(5, 4))
    inputs = torch.randn(9, 4)
    model.module.eval()
    torch.save({"inputs": inputs, "outputs": model.module(inputs).detach()}, sys.argv[2])
    print("saved", path)
    """
)
SERVER = textwrap.dedent(
    """
    import sys, torch
    # A serving process: no phalanx, no model code on the path.
    loaded = __import__("phalanx.saved_model", fromlist=["load"]).load(sys.argv[1])
    expected = torch.load(sys.argv[2])
    outputs = loaded(expected["inputs"])
    assert torch.allclose(outputs, expected["outputs"], atol=1e-6), (outputs, expected["outputs"])
    print("batch of 2:", tuple(loaded(expected["inputs"][:2]).shape))
    print("model module imported:", "my_model_package" in sys.modules)
    print("strategies imported:", "phalanx.strategies" in sys.modules)
    """
)
NET = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5))
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return torch.softmax(self.head(self.body(x)) * 2.0, dim=-1)
    """
)


def test_save_in_one_process_serve_in_another_without_the_class(tmp_path):
    package = tmp_path / "code"
    package.mkdir()
    (package / "my_model_package.py").write_text(NET)
    export_dir, expected = tmp_path / "export", tmp_path / "expected.pt"
    train = subprocess.run(
        [sys.executable, "-c", TRAINER, str(export_dir), str(expected)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=package,
    )
    assert train.returncode == 0, train.stderr
    assert (export_dir / "saved_model.pt2").is_file()
    serve = subprocess.run(
        [sys.executable, "-c", SERVER, str(export_dir), str(expected)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,  # my_model_package is not importable from here
    )
    assert serve.returncode == 0, serve.stderr
    assert "batch of 2: (2, 3)" in serve.stdout  # the batch axis stayed dynamic
    assert "model module imported: False" in serve.stdout
    assert "strategies imported: False" in serve.stdout


def test_a_pt2_file_name_is_used_as_is(tmp_path):
    model = nn.Sequential(nn.Linear(3, 2))
    path = saved_model.save(model, tmp_path / "m.pt2", torch.randn(4, 3))
    assert path == str(tmp_path / "m.pt2")
    x = torch.randn(6, 3)
    assert torch.allclose(saved_model.load(path)(x), model(x))


def test_an_example_batch_of_one_still_gives_a_dynamic_batch(tmp_path):
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    saved_model.save(model, tmp_path, torch.randn(1, 3))  # torch.export alone would fix the batch to 1
    x = torch.randn(5, 3)
    assert torch.allclose(saved_model.load(tmp_path)(x), model(x))


def test_fixed_batch_when_dynamic_batch_is_off(tmp_path):
    saved_model.save(nn.Linear(3, 2), tmp_path, torch.randn(4, 3), dynamic_batch=False)
    loaded = saved_model.load(tmp_path)
    assert loaded(torch.randn(4, 3)).shape == (4, 2)
    with pytest.raises(Exception, match="4"):
        loaded(torch.randn(5, 3))


def test_missing_artifact_and_non_module_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="HINT: pass the directory or .pt2 file"):
        saved_model.load(tmp_path / "nothing")
    with pytest.raises(TypeError, match="exports a torch.nn.Module or a phalanx.Model"):
        saved_model.save(lambda x: x, tmp_path, torch.randn(2, 3))


def test_only_the_chief_writes(tmp_path, monkeypatch):
    strategy = phalanx.get_strategy()
    monkeypatch.setattr(type(strategy), "is_chief", property(lambda self: False))
    saved_model.save(nn.Linear(3, 2), tmp_path / "export", torch.randn(4, 3))
    assert not (tmp_path / "export").exists()
