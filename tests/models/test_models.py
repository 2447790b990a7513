"""Real architectures in tiny configurations, trained under every synchronous strategy and
``Model.fit``, compared with one device (the tests/models tier).

HF transformers BERT and GPT-2 (tied embeddings) and ResNet (BatchNorm: float64 and
``sync_batch_norm=True``), an LSTM with AdamW and a learning-rate scheduler,
``nn.TransformerEncoder`` (it deep-copies its layer), activation checkpointing,
``torch.compile``, a sparse embedding, gradient clipping between ``backward()`` and
``step()``, and float16 autocast with torch's own ``torch.amp.GradScaler``. The custom loop
also runs under ParameterServerStrategy (a chief, 2 workers, 1 ps), one scheduled step at a
time, which is one device's trajectory. Models are built from configurations, never downloaded
(``HF_HUB_OFFLINE=1``). Needs the ``models`` extra (``pip install -e ".[test,models]"``);
without transformers the HF models are skipped and the others still run.

Each model is a classifier (input -> logits of shape (batch, classes)) so that the custom loop
and ``fit`` share one loss; 3 steps of global batch 8. Weights are compared after training:
float32 to 1e-4 relative (sums in another order), float64 (ResNet) to 1e-9.
"""

from __future__ import annotations

import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: configs only

from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import phalanx
from support.strategies import ProcessRunner

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
GLOBAL_BATCH, STEPS, CLASSES, VOCAB, SEQ = 8, 3, 3, 32, 8


# ---------------------------------------------------------------------------- the models
class Logits(nn.Module):
    """An HF model's logits, optionally of the last position only (GPT-2's next token)."""

    def __init__(self, model: nn.Module, last: bool = False) -> None:
        super().__init__()
        self.model, self.last = model, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x).logits
        return logits[:, -1, :CLASSES] if self.last else logits


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return Logits(BertForSequenceClassification(config))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )  # fmt: skip
    return Logits(GPT2LMHeadModel(config), last=True)


def _resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        layer_type="basic", num_labels=CLASSES,
    )  # fmt: skip
    return Logits(ResNetForImageClassification(config))


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(self.embed(x))
        return self.head(h[-1])


class EncoderClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


class CheckpointedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(12, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)  # recomputed in backward
        return self.head(x)


def _compiled() -> nn.Module:
    # aot_eager: Dynamo's graph capture and AOTAutograd without inductor's C++ build, which
    # takes about a minute per process on a 2-core machine
    return torch.compile(
        nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, CLASSES)), backend="aot_eager"
    )


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8, sparse=True)  # sparse gradients
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x).mean(1))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _ids(generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ), generator=generator)


def _vectors(generator: torch.Generator) -> torch.Tensor:
    return torch.randn(STEPS * GLOBAL_BATCH, 12, generator=generator)


def _images(generator: torch.Generator) -> torch.Tensor:
    return torch.randn(STEPS * GLOBAL_BATCH, 3, 16, 16, generator=generator, dtype=torch.float64)


def _sgd(params: Any) -> tuple[torch.optim.Optimizer, Any]:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9), None


def _plain_sgd(params: Any) -> tuple[torch.optim.Optimizer, Any]:
    return torch.optim.SGD(params, lr=0.5), None  # no momentum: takes sparse gradients


def _adamw_with_schedule(params: Any) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


# name: (builder, inputs, optimizer (and scheduler), float64, needs transformers)
# SGD for attention models: the key bias's true gradient is 0, and Adam would scale float noise up.
MODELS: dict[
    str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], Callable[..., Any], bool, bool]
] = {
    "bert": (_bert, _ids, _sgd, False, True),
    "gpt2_tied": (_gpt2, _ids, _sgd, False, True),
    "resnet_batchnorm": (_resnet, _images, _sgd, True, True),
    "lstm_adamw_scheduler": (LSTMClassifier, _ids, _adamw_with_schedule, False, False),
    "transformer_encoder": (EncoderClassifier, _ids, _sgd, False, False),
    "activation_checkpointing": (CheckpointedMLP, _vectors, _sgd, False, False),
    "torch_compile": (_compiled, _vectors, _sgd, False, False),
    "sparse_embedding": (SparseBag, _ids, _plain_sgd, False, False),
    "clip_grad_norm": (_mlp, _vectors, _sgd, False, False),
    "grad_scaler_float16": (_mlp, _vectors, _sgd, False, False),
}
# how a step treats the gradient between backward() and step(): clipped (to a norm the
# gradients exceed), or float16 autocast with torch's own GradScaler (unscale_, then clip)
STEP_STYLE = {"clip_grad_norm": "clip", "grad_scaler_float16": "scaler"}
AVAILABLE = [name for name, spec in MODELS.items() if HAS_TRANSFORMERS or not spec[4]]
# FullyShardedStrategy refuses sparse gradients (FSDP2 has no sparse reduce-scatter), and
# torch.amp.GradScaler does not see FSDP2's sharded gradients (its ShardedGradScaler does)
FSDP_MODELS = [name for name in AVAILABLE if name not in ("sparse_embedding", "grad_scaler_float16")]


def _build(strategy: phalanx.Strategy, name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    build, inputs, _, float64, _ = MODELS[name]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if float64 else torch.float32)
    try:
        with strategy.scope():
            model = build()
    finally:
        torch.set_default_dtype(default)
    generator = torch.Generator().manual_seed(1)
    x = inputs(generator)
    return model, x, torch.randint(0, CLASSES, (len(x),), generator=generator)


def _weights(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, name: str) -> Callable[..., torch.Tensor]:
    """The replica function of one training step of model ``name``."""
    style = STEP_STYLE.get(name)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if style == "scaler" else None

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        if scaler is None:
            logits = model(xb)
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(xb).float()  # the loss in float32
        losses = nn.functional.cross_entropy(logits, yb, reduction="none")
        loss = phalanx.compute_average_loss(losses, global_batch_size=GLOBAL_BATCH)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        if style is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # the summed gradient's norm
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        return loss

    return step


def _finish(model: nn.Module, name: str) -> dict[str, np.ndarray]:
    weights = _weights(model)
    if name == "gpt2_tied":
        inner = model.model
        weights["tied"] = np.array(inner.lm_head.weight is inner.transformer.wte.weight)
    return weights


def train(strategy: phalanx.Strategy, name: str) -> dict[str, np.ndarray]:
    """STEPS custom-loop steps of model ``name``; its weights after them."""
    model, x, y = _build(strategy, name)
    with strategy.scope():
        optimizer, scheduler = MODELS[name][2](model.parameters())
    step = _step(model, optimizer, name)
    dataset = phalanx.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    for batch in strategy.experimental_distribute_dataset(dataset):
        strategy.run(step, args=batch)
        if scheduler is not None:
            scheduler.step()  # outside run, once per step, as in TF
    return _finish(model, name)


def train_ps(strategy: phalanx.Strategy, name: str) -> dict[str, np.ndarray]:
    """The same steps scheduled on the workers of a parameter-server cluster, one at a time
    (each on whichever worker is free): asynchronous training that is sequential here."""
    # this test module is not importable by name on the workers: its classes travel by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    model, x, y = _build(strategy, name)
    with strategy.scope():
        optimizer, scheduler = MODELS[name][2](model.parameters())
    coordinator = strategy.cluster_coordinator or phalanx.coordinator.ClusterCoordinator(strategy)
    step = _step(model, optimizer, name)
    for k in range(STEPS):
        batch = slice(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)
        coordinator.schedule(step, args=(x[batch], y[batch]))
        coordinator.join()
        if scheduler is not None:
            scheduler.step()
    return _finish(model, name)


def fit(strategy: phalanx.Strategy, name: str) -> dict[str, np.ndarray]:
    """The same steps through ``Model.fit`` (no scheduler: fit steps none)."""
    module, x, y = _build(strategy, name)
    with strategy.scope():
        model = phalanx.Model(module)
        optimizer, _ = MODELS[name][2](model.parameters())
        model.compile(
            optimizer=optimizer, loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    model.fit(x.numpy(), y.numpy(), batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    return _weights(module)


def train_all(strategy: phalanx.Strategy, names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """Every model in one cluster (one process start for the whole tier)."""
    return {name: train(strategy, name) for name in names}


def train_all_ps(strategy: phalanx.Strategy, names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """Every model in one parameter-server cluster."""
    return {name: train_ps(strategy, name) for name in names}


# ---------------------------------------------------------------------------- the tests
IN_PROCESS = {
    "mirrored": lambda: phalanx.MirroredStrategy(["cpu:0", "cpu:1"], sync_batch_norm=True),
    "central_storage": lambda: phalanx.CentralStorageStrategy(["cpu:0", "cpu:1"], sync_batch_norm=True),
}


def _assert_same(name: str, expected: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    tolerance = {"rtol": 1e-9, "atol": 1e-11} if MODELS[name][3] else {"rtol": 1e-4, "atol": 1e-5}
    if STEP_STYLE.get(name) == "scaler":
        tolerance = {"rtol": 1e-3, "atol": 1e-4}  # float16 compute of other batch shapes
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, err_msg=f"{name}: {key}", **tolerance)


def _in_process(kind: str, function: Callable[..., dict[str, np.ndarray]]) -> dict[str, Any]:
    strategy = IN_PROCESS[kind]() if kind != "one_device" else phalanx.OneDeviceStrategy("cpu")
    try:
        return {name: function(strategy, name) for name in AVAILABLE}
    finally:
        if kind != "one_device":
            strategy._threads.close()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every model's weights under every strategy (computed once for the module)."""
    done = {kind: _in_process(kind, train) for kind in ("one_device", *IN_PROCESS)}
    runner = ProcessRunner("mwms_2workers", "MultiWorkerMirroredStrategy", tmp_path_factory.mktemp("mwms"), 2)
    workers = runner.run(train_all, AVAILABLE, strategy_kwargs={"sync_batch_norm": True}, timeout=240)
    for index, result in enumerate(workers):
        done[f"mwms_worker{index}"] = result
    ps = ProcessRunner("ps", "ParameterServerStrategy", tmp_path_factory.mktemp("ps"), 2, chief=True, ps=1)
    (done["parameter_server"],) = ps.run(train_all_ps, AVAILABLE, timeout=240)
    done["fit_one_device"] = _in_process("one_device", fit)
    done["fit_mirrored"] = _in_process("mirrored", fit)
    return done


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every model's weights on each of 2 FullyShardedStrategy workers, and on one device."""
    fsdp = ProcessRunner("fsdp", "experimental.FullyShardedStrategy", tmp_path_factory.mktemp("fsdp"), 2)
    sharded = fsdp.run(train_all, FSDP_MODELS, strategy_kwargs={"sync_batch_norm": True}, timeout=240)
    done = {f"fsdp_worker{index}": result for index, result in enumerate(sharded)}
    done["one_device"] = _in_process("one_device", train)
    return done


def _hf(name: str) -> Any:
    marks = [
        pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers: pip install -e '.[models]'")
    ]
    return pytest.param(name, marks=marks) if MODELS[name][4] else name


NAMES = [_hf(name) for name in MODELS]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy", ["mirrored", "central_storage", "mwms_worker0", "mwms_worker1", "parameter_server"]
)
@pytest.mark.parametrize("name", NAMES)
def test_custom_loop_matches_one_device(results, strategy, name):
    _assert_same(name, results["one_device"][name], results[strategy][name])


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp_worker0", "fsdp_worker1"])
@pytest.mark.parametrize(
    "name", [name for name in NAMES if getattr(name, "values", [name])[0] in FSDP_MODELS]
)
def test_custom_loop_under_fully_sharded_matches_one_device(sharded_results, strategy, name):
    _assert_same(name, sharded_results["one_device"][name], sharded_results[strategy][name])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_fit_under_mirrored_matches_one_device(results, name):
    _assert_same(name, results["fit_one_device"][name], results["fit_mirrored"][name])
    if MODELS[name][2] is _sgd and name not in STEP_STYLE:  # fit takes the plain loop's steps
        custom_loop = {k: v for k, v in results["one_device"][name].items() if k != "tied"}
        _assert_same(name, custom_loop, results["fit_one_device"][name])


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers: pip install -e '.[models]'")
@pytest.mark.multiprocess
def test_gpt2_keeps_its_tied_embeddings_everywhere(results):
    for strategy in ("one_device", "mirrored", "central_storage", "mwms_worker0"):
        assert bool(results[strategy]["gpt2_tied"]["tied"]), strategy


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers: pip install -e '.[models]'")
@pytest.mark.multiprocess
def test_gpt2_keeps_its_tied_embeddings_under_fully_sharded(sharded_results):
    assert bool(sharded_results["fsdp_worker0"]["gpt2_tied"]["tied"])
