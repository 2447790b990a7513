"""load_model(path) rebuilds models made of torch.nn layers and containers without their class."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch
from torch import nn

import phalanx
from phalanx.keras import architecture

# One instance of every allow-listed layer, with arguments other than the defaults where it has any.
LAYERS = {
    "CELU": nn.CELU(alpha=0.5),
    "ELU": nn.ELU(alpha=0.3),
    "GELU": nn.GELU(approximate="tanh"),
    "GLU": nn.GLU(dim=0),
    "Hardshrink": nn.Hardshrink(0.3),
    "Hardsigmoid": nn.Hardsigmoid(),
    "Hardswish": nn.Hardswish(),
    "Hardtanh": nn.Hardtanh(-2.0, 2.0),
    "LeakyReLU": nn.LeakyReLU(0.2),
    "LogSigmoid": nn.LogSigmoid(),
    "LogSoftmax": nn.LogSoftmax(dim=0),
    "Mish": nn.Mish(),
    "PReLU": nn.PReLU(3, init=0.1),
    "ReLU": nn.ReLU(),
    "ReLU6": nn.ReLU6(),
    "SELU": nn.SELU(),
    "SiLU": nn.SiLU(),
    "Sigmoid": nn.Sigmoid(),
    "Softmax": nn.Softmax(dim=0),
    "Softmin": nn.Softmin(dim=0),
    "Softplus": nn.Softplus(beta=2.0, threshold=10.0),
    "Softshrink": nn.Softshrink(0.2),
    "Softsign": nn.Softsign(),
    "Tanh": nn.Tanh(),
    "Tanhshrink": nn.Tanhshrink(),
    "Threshold": nn.Threshold(0.1, 20.0),
    "Identity": nn.Identity(),
    "Linear": nn.Linear(3, 4, bias=False),
    "Bilinear": nn.Bilinear(2, 3, 4),
    "Conv1d": nn.Conv1d(2, 4, 3, stride=2, padding=1, dilation=1, groups=2, bias=False),
    "Conv2d": nn.Conv2d(2, 4, (3, 2), padding="same", padding_mode="reflect"),
    "Conv3d": nn.Conv3d(1, 2, 3),
    "ConvTranspose1d": nn.ConvTranspose1d(2, 3, 3, stride=2, output_padding=1),
    "ConvTranspose2d": nn.ConvTranspose2d(2, 3, 3),
    "ConvTranspose3d": nn.ConvTranspose3d(1, 2, 2),
    "MaxPool1d": nn.MaxPool1d(3, stride=2, padding=1, ceil_mode=True),
    "MaxPool2d": nn.MaxPool2d(2),
    "MaxPool3d": nn.MaxPool3d(2),
    "AvgPool1d": nn.AvgPool1d(3, count_include_pad=False),
    "AvgPool2d": nn.AvgPool2d(2, divisor_override=3),
    "AvgPool3d": nn.AvgPool3d(2),
    "AdaptiveAvgPool1d": nn.AdaptiveAvgPool1d(5),
    "AdaptiveAvgPool2d": nn.AdaptiveAvgPool2d((2, 3)),
    "AdaptiveAvgPool3d": nn.AdaptiveAvgPool3d(2),
    "AdaptiveMaxPool1d": nn.AdaptiveMaxPool1d(4),
    "AdaptiveMaxPool2d": nn.AdaptiveMaxPool2d(2),
    "AdaptiveMaxPool3d": nn.AdaptiveMaxPool3d(2),
    "BatchNorm1d": nn.BatchNorm1d(4, eps=1e-3, momentum=0.2),
    "BatchNorm2d": nn.BatchNorm2d(4, affine=False),
    "BatchNorm3d": nn.BatchNorm3d(4, track_running_stats=False),
    "LayerNorm": nn.LayerNorm([3, 4], elementwise_affine=True, bias=False),
    "GroupNorm": nn.GroupNorm(2, 4, eps=1e-4),
    "InstanceNorm1d": nn.InstanceNorm1d(3, affine=True),
    "InstanceNorm2d": nn.InstanceNorm2d(3),
    "InstanceNorm3d": nn.InstanceNorm3d(3),
    "LocalResponseNorm": nn.LocalResponseNorm(3, alpha=2e-4),
    "Dropout": nn.Dropout(0.3),
    "Dropout1d": nn.Dropout1d(0.2),
    "Dropout2d": nn.Dropout2d(0.2),
    "Dropout3d": nn.Dropout3d(0.2),
    "AlphaDropout": nn.AlphaDropout(0.1),
    "Embedding": nn.Embedding(10, 3, padding_idx=0, max_norm=2.0),
    "EmbeddingBag": nn.EmbeddingBag(10, 3, mode="max"),
    "RNN": nn.RNN(3, 4, num_layers=2, nonlinearity="relu", batch_first=True),
    "LSTM": nn.LSTM(3, 4, bidirectional=True, proj_size=2),
    "GRU": nn.GRU(3, 4, bias=False, dropout=0.0),
    "Flatten": nn.Flatten(0, -1),
    "Unflatten": nn.Unflatten(1, (2, 3)),
    "Upsample": nn.Upsample(scale_factor=2.0, mode="bilinear", align_corners=True),
    "ZeroPad1d": nn.ZeroPad1d(2),
    "ZeroPad2d": nn.ZeroPad2d((1, 2, 3, 4)),
    "ZeroPad3d": nn.ZeroPad3d(1),
    "ConstantPad1d": nn.ConstantPad1d(2, 3.5),
    "ConstantPad2d": nn.ConstantPad2d(1, 0.5),
    "ConstantPad3d": nn.ConstantPad3d(1, 0.5),
    "ReflectionPad1d": nn.ReflectionPad1d(2),
    "ReflectionPad2d": nn.ReflectionPad2d(1),
    "ReplicationPad1d": nn.ReplicationPad1d(2),
    "ReplicationPad2d": nn.ReplicationPad2d(1),
    "ReplicationPad3d": nn.ReplicationPad3d(1),
    "PixelShuffle": nn.PixelShuffle(2),
    "PixelUnshuffle": nn.PixelUnshuffle(2),
    "CosineSimilarity": nn.CosineSimilarity(dim=0, eps=1e-6),
    "PairwiseDistance": nn.PairwiseDistance(p=1.0, keepdim=True),
}


def test_the_table_covers_the_allow_list():
    assert set(LAYERS) == architecture.ALLOWED_LAYERS


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_every_allow_listed_layer_round_trips(name):
    layer = LAYERS[name]
    node = architecture.describe(layer)
    assert node is not None, f"{name} is allow-listed but not describable"
    rebuilt = architecture.build(node)
    assert type(rebuilt) is type(layer)
    assert repr(rebuilt) == repr(layer)  # every hyperparameter extra_repr shows
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {
        k: v.shape for k, v in layer.state_dict().items()
    }
    assert rebuilt.__dict__.keys() == layer.__dict__.keys()
    for key, value in layer.__dict__.items():
        if not key.startswith("_") and not isinstance(value, torch.Tensor):
            assert getattr(rebuilt, key) == value, key


def _nested():
    return nn.Sequential(
        OrderedDict(
            stem=nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()),
            blocks=nn.ModuleList([nn.Flatten(), nn.Linear(4 * 8 * 8, 16)]),
            heads=nn.ModuleDict({"logits": nn.Linear(16, 10), "act": nn.Dropout(0.1)}),
        )
    )


def _runnable():
    return nn.Sequential(
        OrderedDict(
            stem=nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()),
            head=nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 16), nn.Dropout(0.1), nn.Linear(16, 10)),
        )
    )


def test_nested_containers_round_trip():
    model = _nested()
    rebuilt = architecture.build(architecture.describe(model))
    assert repr(rebuilt) == repr(model)
    rebuilt.load_state_dict(model.state_dict())  # strict: the same parameters and buffers


def test_custom_classes_and_subclasses_are_not_described():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

    class MyLinear(nn.Linear):
        pass

    assert architecture.describe(Net()) is None
    assert architecture.describe(nn.Sequential(nn.Linear(2, 2), MyLinear(2, 2))) is None
    assert architecture.describe(nn.MultiheadAttention(4, 2)) is None  # has submodules of its own


def test_load_model_rebuilds_a_sequential_without_the_class_or_module(tmp_path, mirrored_2cpu):
    x = torch.randn(12, 20)
    y = torch.randint(0, 10, (12,))
    with mirrored_2cpu.scope():
        model = phalanx.Model(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10)))
        model.compile(optimizer="adam", loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = str(tmp_path / "model.pt")
    model.save(path)
    loaded = phalanx.load_model(path)  # the failure: "Unexpected key(s) in state_dict"
    assert isinstance(loaded.module, nn.Sequential)
    torch.testing.assert_close(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)  # the optimizer state came back too


def test_load_model_in_a_fresh_process_that_has_only_the_file(tmp_path, one_device):
    with one_device.scope():
        model = phalanx.Model(_runnable())
    model.save(str(tmp_path / "m.pt"))
    expected = model.predict(torch.ones(2, 1, 8, 8), verbose=0)
    torch.save(expected, tmp_path / "expected.pt")
    code = textwrap.dedent(
        f"""
        import torch, phalanx
        model = phalanx.load_model({str(tmp_path / "m.pt")!r})
        got = model.predict(torch.ones(2, 1, 8, 8), verbose=0)
        assert torch.allclose(got, torch.load({str(tmp_path / "expected.pt")!r})), got
        print("rebuilt", type(model.module).__name__)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "rebuilt Sequential" in done.stdout


def test_a_custom_class_that_is_not_imported_gives_the_module_hint(tmp_path, one_device):
    code = textwrap.dedent(
        """
        import sys, torch, phalanx
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(3, 2)
            def forward(self, x):
                return self.fc(x)
        phalanx.Model(Net()).save(sys.argv[1])
        """
    )
    path = str(tmp_path / "custom.pt")
    subprocess.run([sys.executable, "-c", code, path], check=True, timeout=120)
    hint = r"HINT: pass the module: phalanx.load_model\(path, module=Net\(\)\)"
    with pytest.raises(ValueError, match=hint):
        phalanx.load_model(path)
    with one_device.scope():
        net = nn.Module()
        net.fc = nn.Linear(3, 2)
        loaded = phalanx.load_model(path, module=net)
    assert loaded.module is net
