"""ModelParallelStrategy with real processes on 127.0.0.1: a model split along the model axis
(2 workers) and along batch x model (4 workers) trains to one device's losses and weights,
each worker holding only its part of every split weight."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

import phalanx
from phalanx.experimental import DeviceMesh, LayoutMap
from phalanx.train import Checkpoint
from support.strategies import ProcessRunner

pytestmark = pytest.mark.multiprocess
GLOBAL_BATCH, STEPS, VOCAB, DIM = 8, 3, 16, 16
TOL = {"rtol": 1e-5, "atol": 1e-6}


class MLP(nn.Module):
    """A split pair (column then row) between replicated layers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 6))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.net(x)))


class Attention(nn.Module):
    """torchtitan's attention: wq/wk/wv split by columns, wo by rows; the head count of the
    local part is left to torch (``-1``)."""

    def __init__(self, dim: int = DIM, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, local heads, s, head_dim)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """torchtitan's gated feed-forward: w1/w3 split by columns, w2 by rows."""

    def __init__(self, dim: int = DIM, hidden: int = 32) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """An embedding split by rows, one block, an output layer split by columns (gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block()])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


LAYOUTS = {
    "mlp": {
        r"net\.0\.weight": ("model", None),
        r"net\.0\.bias": ("model",),
        r"net\.2\.weight": (None, "model"),
    },
    "transformer": {
        "tok_embeddings.weight": ("model", None),
        r"layers\.\d+\.attention\.w[qkv]\.weight": ("model", None),
        r"layers\.\d+\.attention\.wo\.weight": (None, "model"),
        r"layers\.\d+\.feed_forward\.w[13]\.weight": ("model", None),
        r"layers\.\d+\.feed_forward\.w[13]\.bias": ("model",),
        r"layers\.\d+\.feed_forward\.w2\.weight": (None, "model"),
        "output.weight": ("model", None),
    },
}


def layout_map(kind: str, shape: tuple[int, ...], names: tuple[str, ...]) -> LayoutMap:
    layouts = LayoutMap(DeviceMesh(shape, names))
    for key, axes in LAYOUTS[kind].items():
        layouts[key] = axes
    return layouts


def _data(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    if kind == "mlp":
        return [
            (torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randint(0, 4, (GLOBAL_BATCH,), generator=gen))
            for _ in range(STEPS)
        ]
    tokens = [torch.randint(0, VOCAB, (GLOBAL_BATCH, 6), generator=gen) for _ in range(STEPS)]
    return [(t, t.roll(-1, dims=1)) for t in tokens]


def train(
    strategy: phalanx.Strategy, kind: str, meta: bool = False, folder: str | None = None, clip: float = 0.0
) -> dict:
    """The custom loop (each worker): SGD with momentum, TF's loss convention, optional clipping."""
    torch.manual_seed(10 + strategy.worker_rank)  # different on every worker: the chief's must win
    with strategy.scope(), torch.device("meta" if meta else "cpu"):
        model = MLP() if kind == "mlp" else Transformer()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    split_logits = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        split_logits.append(isinstance(logits, DTensor))  # loss parallel: split over the classes
        per_example = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        per_example = per_example.reshape(y.shape[0], -1).mean(dim=1)
        loss = phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        if clip:
            norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            assert float(norm) > clip, "the test must clip"
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = []
    for x, y in strategy.experimental_distribute_dataset(_data(kind)):
        loss = strategy.run(step, args=(x, y))
        losses.append(strategy.reduce("sum", loss, axis=None).item())
    last_batch = strategy.gather(x, axis=0)  # the replicas' slices, in replica order
    local = {
        n: tuple((p.to_local() if hasattr(p, "to_local") else p).shape) for n, p in model.named_parameters()
    }
    result = {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "local": local,
        "split_logits": set(split_logits),
        "last_batch": last_batch,
    }
    if folder is not None:
        result["path"] = Checkpoint(model=model, optimizer=optimizer).save(os.path.join(folder, "ckpt"))
    return result


def restore(strategy: phalanx.Strategy, kind: str, path: str) -> dict:
    with strategy.scope():
        model = MLP() if kind == "mlp" else Transformer()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    Checkpoint(model=model, optimizer=optimizer).read(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _one_device(kind: str, clip: float = 0.0) -> dict:
    return train(phalanx.OneDeviceStrategy("cpu:0"), kind, False, None, clip)


def _same_weights(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert type(got[key]) is torch.Tensor, f"{key}: state_dict() outside run gives full tensors"
        np.testing.assert_allclose(got[key].numpy(), value.numpy(), **TOL, err_msg=key)


def _runner(tmp_path: Path, workers: int, name: str = "runs") -> ProcessRunner:
    (tmp_path / name).mkdir()
    return ProcessRunner("model_parallel", "experimental.ModelParallelStrategy", tmp_path / name, workers)


def _local_shape(kind: str, name: str, shape: tuple[int, ...], model: int, data: int) -> tuple[int, ...]:
    """The part of parameter ``name`` one worker holds: its split dimension / model, then
    dimension 0 / data (FSDP2)."""
    layout = next((a for k, a in LAYOUTS[kind].items() if k == name or re.fullmatch(k, name)), None)
    local = list(shape)
    if layout is not None:
        for dim, axis in enumerate(layout):
            if axis == "model":
                local[dim] //= model
    local[0] = -(-local[0] // data)
    return tuple(local)


@pytest.mark.parametrize(
    ("kind", "loss_parallel"), [("mlp", None), ("transformer", None), ("transformer", "output")]
)
def test_split_along_the_model_axis_two_workers_train_to_one_devices_weights(kind, loss_parallel, tmp_path):
    clip = 0.05 if kind == "transformer" else 0.0  # clipping's norm spans split and replicated weights
    expected = _one_device(kind, clip)
    layouts = layout_map(kind, (2,), ("model",))
    results = _runner(tmp_path, 2).run(
        train,
        kind,
        False,
        str(tmp_path),
        clip,
        strategy_kwargs={"layout_map": layouts, "loss_parallel": loss_parallel},
    )
    for worker in results:
        np.testing.assert_allclose(worker["losses"], expected["losses"], **TOL)
        _same_weights(worker["state"], expected["state"])
        assert worker["split_logits"] == {loss_parallel is not None}
        for name, full in expected["state"].items():
            if name in worker["local"]:
                assert worker["local"][name] == _local_shape(kind, name, tuple(full.shape), 2, 1), name
    split = "tok_embeddings.weight" if kind == "transformer" else "net.0.weight"
    assert results[0]["local"][split][0] == expected["state"][split].shape[0] // 2
    # the sharded checkpoint restores on one device with the trained weights
    _same_weights(restore(phalanx.OneDeviceStrategy("cpu:0"), kind, results[0]["path"]), expected["state"])


def test_batch_by_model_four_workers_train_a_transformer_block_to_one_devices_weights(tmp_path):
    # built on the meta device: each worker materialises one layer at a time, the chief's values win
    expected = _one_device("transformer", 0.05)
    layouts = layout_map("transformer", (2, 2), ("batch", "model"))
    results = _runner(tmp_path, 4).run(
        train, "transformer", True, None, 0.05, strategy_kwargs={"layout_map": layouts}, timeout=300
    )
    for worker in results:
        np.testing.assert_allclose(worker["losses"], expected["losses"], **TOL)
        _same_weights(worker["state"], expected["state"])
        for name, full in expected["state"].items():
            assert worker["local"][name] == _local_shape("transformer", name, tuple(full.shape), 2, 2), name
        torch.testing.assert_close(worker["last_batch"], _data("transformer")[-1][0], rtol=0, atol=0)


def fit(strategy: phalanx.Strategy, policy: str, folder: str | None = None) -> dict:
    """Model.fit with a mixed-precision policy, an accuracy metric and a weights checkpoint per
    epoch (a sharded DCP folder under ModelParallelStrategy)."""
    torch.manual_seed(10 + strategy.worker_rank)
    phalanx.mixed_precision.set_global_policy(policy)
    try:
        x, y = (torch.cat(parts) for parts in zip(*_data("mlp"), strict=True))
        with strategy.scope():
            model = phalanx.Model(MLP())
            model.compile(
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        callbacks = []
        if folder is not None:
            path = os.path.join(folder, "w-{epoch}.dcp")
            callbacks.append(phalanx.callbacks.ModelCheckpoint(path, save_weights_only=True))
        history = model.fit(
            x.numpy(),
            y.numpy(),
            batch_size=GLOBAL_BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        return {
            "history": history.history,
            "state": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        }
    finally:
        phalanx.mixed_precision.set_global_policy("float32")


def restore_weights(strategy: phalanx.Strategy, path: str) -> dict:
    with strategy.scope():
        model = phalanx.Model(MLP())
    model.load_weights(path)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_model_fit_with_mixed_precision_gives_one_devices_history_and_restores_on_another_mesh(
    policy, tmp_path
):
    expected = fit(phalanx.OneDeviceStrategy("cpu:0"), policy)
    layouts = layout_map("mlp", (2,), ("model",))
    results = _runner(tmp_path, 2).run(fit, policy, str(tmp_path), strategy_kwargs={"layout_map": layouts})
    tol = TOL if policy == "float32" else {"rtol": 1e-2, "atol": 1e-3}  # float16 sums in another order
    for worker in results:
        assert worker["history"].keys() == expected["history"].keys()
        for key, values in expected["history"].items():
            np.testing.assert_allclose(worker["history"][key], values, **tol, err_msg=key)
        for key, value in expected["state"].items():
            np.testing.assert_allclose(worker["state"][key].numpy(), value.numpy(), **tol, err_msg=key)
    if policy == "float32":  # the model-axis checkpoint, read by two workers that split the batch
        data_parallel = LayoutMap(DeviceMesh((2,), ("batch",)))
        path = str(tmp_path / "w-2.dcp")
        for state in _runner(tmp_path, 2, "restore").run(
            restore_weights, path, strategy_kwargs={"layout_map": data_parallel}
        ):
            _same_weights(state, results[0]["state"])


def refused(strategy: phalanx.Strategy, folder: str) -> list[str]:
    """What a two-worker model axis refuses: a layer whose split dimension (3) the axis (2)
    does not divide, input pipelines per worker, and a dataset split by file."""
    messages = []
    try:
        with strategy.scope():
            model = nn.Sequential(nn.Linear(4, 3))
        messages.append(f"not refused: {model}")
    except ValueError as error:
        messages.append(str(error))
    for attempt in (
        lambda: strategy.distribute_datasets_from_function(lambda context: []),
        lambda: strategy.experimental_distribute_dataset(phalanx.data.Dataset.list_files(f"{folder}/*.txt")),
    ):
        try:
            attempt()
            messages.append("not refused")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_what_a_model_axis_cannot_take_is_refused_on_every_worker(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("1\n")
    layouts = LayoutMap(DeviceMesh((2,), ("model",)))
    layouts[r"0\.weight"] = ("model", None)
    for scope, per_worker, files in _runner(tmp_path, 2).run(
        refused, str(tmp_path), strategy_kwargs={"layout_map": layouts}
    ):
        assert "Dimension 0 of '0.weight' (3) is not divisible by the 2 workers of mesh axis" in scope
        assert "one input pipeline per worker" in per_worker
        assert "HINT: use experimental_distribute_dataset" in per_worker
        assert "AutoShardPolicy.DATA" in files
