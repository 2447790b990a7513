"""Weights files loaded straight into FullySharded shards, and saved from them: 2 workers build
a model on the meta device, load it from a torch state-dict file (the plain
``load_state_dict(torch.load(path, mmap=True))``), a safetensors file, a Hugging Face folder
with an index, or a phalanx DCP folder, train, and end at one device's losses and weights; the
layers the source fills get no initial values (no reset on the chief); the end weights are
saved as safetensors by every worker writing its own rows."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import phalanx
from phalanx.checkpoint.weights import save_safetensors
from phalanx.train import Checkpoint
from support.strategies import ProcessRunner

pytestmark = pytest.mark.multiprocess
GLOBAL_BATCH, STEPS = 8, 3
TOL = {"rtol": 1e-5, "atol": 1e-6}
RESETS: list[str] = []  # the modules whose reset_parameters() ran in this process


class Counted(nn.Linear):
    """A linear layer that records each reset_parameters() (the chief's initial values)."""

    def reset_parameters(self) -> None:
        RESETS.append(f"{self.in_features}x{self.out_features}")
        super().reset_parameters()


class Scale(nn.Module):
    """A persistent buffer made on the meta device (its values come from the source)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.empty(n))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Net(nn.Module):
    """Sizes that do not divide by 2 (uneven shards), a norm and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = Counted(7, 33, bias=False)
        self.hidden = nn.Sequential(Counted(33, 33), nn.Tanh(), Counted(33, 33))
        self.norm = nn.LayerNorm(33)
        self.scale = Scale(33)
        self.head = Counted(33, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scale(self.norm(torch.relu(self.hidden(self.embed(x))))))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randint(0, 7, (GLOBAL_BATCH,), generator=gen))
        for _ in range(STEPS)
    ]


def _load(strategy: phalanx.Strategy, keras_model: phalanx.Model, how: str, source: str) -> None:
    model = keras_model.module
    if how == "torch":  # the plain PyTorch idiom
        model.load_state_dict(torch.load(source, mmap=True, weights_only=True))
    elif how == "torch-partial":  # the file lacks embed.weight: that layer gets its initial values
        model.load_state_dict(torch.load(source, mmap=True, weights_only=True), strict=False)
    elif how == "model":
        keras_model.load_weights(source)
    elif how == "checkpoint":  # a safetensors file or folder, or a phalanx DCP folder
        Checkpoint(model=model).read(source)
    elif how == "chief-only":  # the chief passes the parameters, the others nothing: they must agree
        state = torch.load(source, mmap=True, weights_only=True) if strategy.worker_rank == 0 else {}
        state.pop("scale.scale", None)  # a buffer is a variable: loading it is every worker's collective
        model.load_state_dict(state, strict=False)
    else:
        raise AssertionError(how)


def train_from(strategy: phalanx.Strategy, how: str, source: str, out: str = "") -> dict:
    """Builds Net (on the meta device under FullySharded), loads it from ``source``, trains
    STEPS steps of TF's loss convention; optionally saves the end weights as safetensors."""
    meta = isinstance(strategy, phalanx.experimental.FullyShardedStrategy)
    RESETS.clear()
    torch.manual_seed(10 + strategy.worker_rank)  # the chief's (10) is one device's
    with strategy.scope(), torch.device("meta" if meta else "cpu"):
        keras_model = phalanx.Model(Net())
        model = keras_model.module
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    built = len(RESETS)  # the constructors' own resets (on the meta device: no values)
    _load(strategy, keras_model, how, source)
    resets = RESETS[built:]  # the chief's initial values: the layers the source does not fill
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = []
    for x, y in strategy.experimental_distribute_dataset(_data()):
        losses.append(strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None).item())
    if out:
        keras_model.save_weights(os.path.join(out, "end.safetensors"))
        save_safetensors(model, os.path.join(out, "end-folder"), max_shard_size=1500)
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "resets": resets,
        "local": local,
        "full": sum(p.numel() for p in model.parameters()),
    }


def _sources(folder: Path) -> dict[str, str]:
    """The same initial weights in every format (written here, by one process)."""
    torch.manual_seed(0)
    model = Net()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    sources = {"torch": str(folder / "init.pt"), "safetensors": str(folder / "init.safetensors")}
    torch.save(state, sources["torch"])
    save_file(state, sources["safetensors"])
    torch.save({k: v for k, v in state.items() if k != "embed.weight"}, folder / "partial.pt")
    sources["partial"] = str(folder / "partial.pt")
    hub = pytest.importorskip("huggingface_hub")  # Hugging Face's own writer: shards + index
    (folder / "hf").mkdir()
    hub.save_torch_state_dict(state, folder / "hf", max_shard_size=2000)
    sources["hf"] = str(folder / "hf")
    Checkpoint(model=model).write(str(folder / "init.dcp"), sharded=True)
    sources["dcp"] = str(folder / "init.dcp")
    return sources


CASES = {  # name: (how, source)
    "torch": ("torch", "torch"),
    "safetensors-model": ("model", "safetensors"),
    "safetensors-checkpoint": ("checkpoint", "safetensors"),
    "hf-folder": ("checkpoint", "hf"),
    "dcp": ("checkpoint", "dcp"),
    "partial": ("torch-partial", "partial"),
    "chief-only": ("chief-only", "torch"),
}


def run_cases(strategy: phalanx.Strategy, sources: dict[str, str], out: str) -> dict:
    """Every case in one cluster (a cluster start costs more than a case)."""
    return {
        name: train_from(strategy, how, sources[source], out if name == "torch" else "")
        for name, (how, source) in CASES.items()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weights")
    sources = _sources(folder)
    out = folder / "out"
    out.mkdir()
    runner = ProcessRunner("fsdp_2workers", "experimental.FullyShardedStrategy", folder / "calls", 2)
    (folder / "calls").mkdir()
    sharded = runner.run(run_cases, sources, str(out), timeout=300)
    one = phalanx.OneDeviceStrategy("cpu")
    try:
        reference = {
            name: train_from(one, CASES[name][0], sources[CASES[name][1]]) for name in ("torch", "partial")
        }
    finally:
        one._threads.close()
    return {"sharded": sharded, "reference": reference, "out": out}


def _assert_state(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(got[key].float().numpy(), value.float().numpy(), **TOL, err_msg=key)


@pytest.mark.parametrize("case", ["torch", "safetensors-model", "safetensors-checkpoint", "hf-folder", "dcp"])
def test_each_source_loads_into_the_shards_and_trains_to_one_devices_weights(runs, case):
    expected = runs["reference"]["torch"]
    for worker in runs["sharded"]:
        got = worker[case]
        np.testing.assert_allclose(got["losses"], expected["losses"], **TOL)
        _assert_state(got["state"], expected["state"])
        assert got["local"] <= got["full"] // 2 + 2 * 33, "each worker holds about half"


@pytest.mark.parametrize("case", ["torch", "safetensors-model", "safetensors-checkpoint", "hf-folder", "dcp"])
def test_layers_a_source_fills_get_no_initial_values(runs, case):
    # built on the meta device and loaded whole: no reset_parameters() on any worker, no scatter
    assert [worker[case]["resets"] for worker in runs["sharded"]] == [[], []]


def test_a_partial_load_gives_the_missing_layer_the_chiefs_initial_values(runs):
    expected = runs["reference"]["partial"]
    chief, other = runs["sharded"]
    assert chief["partial"]["resets"] == ["7x33"]  # the one layer the file lacks, on the chief only
    assert other["partial"]["resets"] == []
    for worker in runs["sharded"]:
        np.testing.assert_allclose(worker["partial"]["losses"], expected["losses"], **TOL)
        _assert_state(worker["partial"]["state"], expected["state"])


def test_workers_that_load_different_keys_agree_to_initialise_every_layer(runs):
    # the chief loads the file, worker 1 an empty dict: every layer is initialised as at a run
    # on both (a layer filled on the chief alone would leave worker 1's rows unset), then the
    # chief's rows take the file's values
    chief, other = runs["sharded"]
    assert sorted(chief["chief-only"]["resets"]) == ["33x33", "33x33", "33x7", "7x33"]
    assert other["chief-only"]["resets"] == []
    assert np.isfinite(chief["chief-only"]["losses"]).all()


def test_the_sharded_model_saves_standard_safetensors_with_each_worker_writing_its_rows(runs):
    expected = runs["reference"]["torch"]["state"]
    single = load_file(runs["out"] / "end.safetensors")  # safetensors' own reader
    _assert_state(single, expected)
    folder = runs["out"] / "end-folder"
    assert sorted(os.listdir(folder)) == [
        *[f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)],
        "model.safetensors.index.json",
    ]
    merged: dict = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            merged.update(load_file(folder / name))
    _assert_state(merged, expected)
    assert not [n for n in os.listdir(runs["out"]) if n.startswith(".tmp-phalanx")]  # no temporary left
