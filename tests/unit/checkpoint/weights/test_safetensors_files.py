"""Safetensors files and Hugging Face folders in one process: round trips in the standard
format, the Model/Checkpoint entry points, a one-worker FullySharded model loaded straight from
files, and every error. Several workers: tests/multiprocess/test_weights_files.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

import phalanx
from phalanx.checkpoint.weights import is_safetensors, load_safetensors, save_safetensors
from phalanx.distribution import slices
from phalanx.experimental import FullyShardedStrategy
from phalanx.train import Checkpoint


class Tied(nn.Module):
    """Input and output layers sharing one weight, a norm with buffers, a 0-d buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


def _same(got: nn.Module, expected: nn.Module) -> None:
    expected_state = expected.state_dict()
    assert got.state_dict().keys() == expected_state.keys()
    for key, value in got.state_dict().items():
        torch.testing.assert_close(value, expected_state[key], msg=key)


def _trained_tied() -> Tied:
    torch.manual_seed(0)
    model = Tied()
    model(torch.randint(0, 11, (8,)))  # running statistics and a batch count that are not the defaults
    return model


def test_a_file_holds_the_state_dict_in_the_standard_format_and_loads_back(tmp_path):
    model = _trained_tied()
    save_safetensors(model, tmp_path / "m.safetensors")
    saved = load_file(tmp_path / "m.safetensors")  # safetensors' own reader
    assert "head.weight" not in saved  # a tied weight is written once, as Hugging Face writes it
    for key, value in saved.items():
        torch.testing.assert_close(value, model.state_dict()[key])
    torch.manual_seed(1)
    fresh = Tied()
    load_safetensors(fresh, tmp_path / "m.safetensors")
    _same(fresh, model)
    assert fresh.head.weight is fresh.embed.weight


def test_a_folder_splits_into_files_with_an_index_and_loads_back(tmp_path):
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4).to(torch.bfloat16))
    save_safetensors(model, tmp_path / "hf", max_shard_size=150)  # 512, 64, 128 + 8 bytes
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    assert index["metadata"]["total_size"] == sum(sizes)
    merged = {}
    for name in files:
        merged.update(load_file(tmp_path / "hf" / name))
    assert merged["1.weight"].dtype == torch.bfloat16
    fresh = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4).to(torch.bfloat16))
    load_safetensors(fresh, tmp_path / "hf")
    _same(fresh, model)
    save_safetensors(model, tmp_path / "one")  # small enough for one file: model.safetensors
    assert os.listdir(tmp_path / "one") == ["model.safetensors"]
    assert is_safetensors(tmp_path / "one")
    assert is_safetensors(tmp_path / "hf")
    assert not is_safetensors(tmp_path)


def test_a_folder_hugging_face_wrote_loads(tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    (tmp_path / "hub").mkdir()
    hub.save_torch_state_dict(model.state_dict(), tmp_path / "hub", max_shard_size=300)
    assert (tmp_path / "hub" / "model.safetensors.index.json").is_file()
    fresh = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    load_safetensors(fresh, tmp_path / "hub")
    _same(fresh, model)


def test_model_and_checkpoint_read_and_write_safetensors(tmp_path):
    torch.manual_seed(0)
    model = phalanx.Model(nn.Linear(3, 2))
    model.save_weights(str(tmp_path / "w.safetensors"))
    assert set(load_file(tmp_path / "w.safetensors")) == {"weight", "bias"}
    fresh = phalanx.Model(nn.Linear(3, 2))
    fresh.load_weights(str(tmp_path / "w.safetensors"))
    _same(fresh.module, model.module)
    other = nn.Linear(3, 2)
    Checkpoint(model=other).read(str(tmp_path / "w.safetensors"))
    _same(other, model.module)
    save_safetensors(model.module, tmp_path / "hf")
    restored = nn.Linear(3, 2)
    Checkpoint(model=restored).restore(str(tmp_path / "hf"))  # a weights folder, not a folder of checkpoints
    _same(restored, model.module)


@pytest.fixture
def one_worker(monkeypatch):
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    made = FullyShardedStrategy()
    yield made
    made.close()
    assert not dist.is_initialized()


class NoReset(nn.Module):
    """A layer without reset_parameters() (as Hugging Face's Conv1D): built on the meta device,
    it can only get its values from a load."""

    def __init__(self, n: int, m: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, m))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


@pytest.mark.parametrize("source", ["torch", "safetensors"])
def test_a_meta_model_loaded_whole_needs_no_reset_and_trains(one_worker, tmp_path, monkeypatch, source):
    torch.manual_seed(0)
    reference = nn.Sequential(NoReset(5, 7), nn.Tanh(), NoReset(7, 3))
    for p in reference.parameters():
        nn.init.normal_(p)
    torch.save(reference.state_dict(), tmp_path / "w.pt")
    halves = {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}
    save_file(halves, tmp_path / "w.safetensors")
    with one_worker.scope(), torch.device("meta"):
        model = nn.Sequential(NoReset(5, 7), nn.Tanh(), NoReset(7, 3))
    if source == "torch":
        model.load_state_dict(torch.load(tmp_path / "w.pt", mmap=True, weights_only=True))
        expected = reference
    else:
        monkeypatch.setattr(slices, "BLOCK_BYTES", 8)  # one row per read: the block path
        load_safetensors(model, tmp_path / "w.safetensors")
        expected = nn.Sequential(NoReset(5, 7), nn.Tanh(), NoReset(7, 3))
        expected.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in reference.state_dict().items()})
    assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters())
    x = torch.randn(4, 5)
    out = one_worker.run(lambda: model(x))
    torch.testing.assert_close(one_worker.experimental_local_results(out)[0], expected(x))
    _same(model, expected)


def test_a_model_that_already_ran_takes_new_weights_into_its_shards(one_worker, tmp_path):
    with one_worker.scope():
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(2, 5)
    one_worker.run(lambda: model(x))  # FSDP2 initialised: its shards are views of padded storage
    new = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    save_file(new.state_dict(), tmp_path / "new.safetensors")
    load_safetensors(model, tmp_path / "new.safetensors")
    out = one_worker.experimental_local_results(one_worker.run(lambda: model(x)))[0]
    torch.testing.assert_close(out, new(x))


def test_a_meta_model_loaded_in_part_still_needs_resets_for_the_rest(one_worker, tmp_path):
    torch.save({"0.weight": torch.ones(5, 7)}, tmp_path / "part.pt")
    with one_worker.scope(), torch.device("meta"):
        model = nn.Sequential(NoReset(5, 7), nn.Tanh(), NoReset(7, 3))
    with pytest.raises(ValueError, match="no reset_parameters"):
        model.load_state_dict(torch.load(tmp_path / "part.pt", mmap=True, weights_only=True), strict=False)


def test_a_shard_of_several_boxes_is_refused_with_what_to_use(one_worker):
    with one_worker.scope():
        model = nn.Linear(4, 2)
    one_worker.materialize_meta()
    one_worker.run(lambda: model(torch.ones(1, 4)))
    weight = model.weight
    assert isinstance(weight, DTensor)
    chunks = weight.__create_chunk_list__()
    weight.__create_chunk_list__ = lambda: chunks * 2  # as a layout of two boxes per worker reports
    with pytest.raises(ValueError, match="one box of each tensor per worker.*sharded \\(DCP\\) checkpoint"):
        slices.region_of(weight)


# ---------------------------------------------------------------------------------- errors
def test_names_that_differ_are_listed_unless_not_strict(tmp_path):
    save_file({"weight": torch.ones(2, 3), "extra": torch.ones(1)}, tmp_path / "w.safetensors")
    model = nn.Linear(3, 2)
    differ = r"Missing from the files: \['bias'\]. Not in the model: \['extra'\]"
    with pytest.raises(ValueError, match=differ):
        load_safetensors(model, tmp_path / "w.safetensors")
    load_safetensors(model, tmp_path / "w.safetensors", strict=False)
    torch.testing.assert_close(model.weight, torch.ones(2, 3), check_device=False)


def test_a_shape_that_differs_is_named(tmp_path):
    save_file({"weight": torch.ones(3, 3), "bias": torch.ones(2)}, tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match=r"'weight' has shape \(3, 3\) in .* and \(2, 3\) in the model"):
        load_safetensors(nn.Linear(3, 2), tmp_path / "w.safetensors")


def test_folders_and_files_that_are_not_safetensors_weights_are_named(tmp_path):
    with pytest.raises(ValueError, match="holds neither model.safetensors.index.json nor model.safetensors"):
        load_safetensors(nn.Linear(3, 2), tmp_path)
    with pytest.raises(FileNotFoundError, match="No safetensors file or folder"):
        load_safetensors(nn.Linear(3, 2), tmp_path / "missing.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="names 'model-00001-of-00002.safetensors', which is not in"):
        load_safetensors(nn.Linear(3, 2), tmp_path)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="has no weight_map"):
        load_safetensors(nn.Linear(3, 2), tmp_path)


def test_a_checkpoint_of_more_than_the_model_cannot_read_safetensors(tmp_path):
    model = nn.Linear(3, 2)
    save_safetensors(model, tmp_path / "w.safetensors")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"holds one model's weights.*tracks \['model', 'optimizer'\]"):
        Checkpoint(model=model, optimizer=optimizer).read(str(tmp_path / "w.safetensors"))


def test_model_save_to_safetensors_says_to_save_the_weights(tmp_path):
    with pytest.raises(ValueError, match="HINT: model.save_weights"):
        phalanx.Model(nn.Linear(3, 2)).save(str(tmp_path / "m.safetensors"))


def test_what_safetensors_cannot_hold_is_refused(tmp_path):
    model = nn.Module()
    model.register_buffer("z", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"no name for dtype\(s\) \['torch.complex64'\]"):
        save_safetensors(model, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="max_shard_size must be a positive number of bytes. Received: 0"):
        save_safetensors(nn.Linear(3, 2), tmp_path / "hf", max_shard_size=0)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-phalanx")]


def test_reading_without_the_safetensors_package_says_how_to_install_it(tmp_path, monkeypatch):
    save_file({"weight": torch.ones(2, 3), "bias": torch.ones(2)}, tmp_path / "w.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"pip install 'phalanx\[safetensors\]'"):
        load_safetensors(nn.Linear(3, 2), tmp_path / "w.safetensors")
