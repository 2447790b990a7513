"""Writing a model's files and its summary: what `phalanx.keras.Model`'s ``save``,
``save_weights``, ``load_weights`` and ``summary`` call (see `phalanx.keras.saving`, which
re-exports them next to ``load_model``, for the format).

Below model.py, so that the model does not import `saving`, whose ``load_model`` builds a Model.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from phalanx.checkpoint import _sharded, _sharded_state
from phalanx.checkpoint._files import atomic_save, chief_path, safe_load
from phalanx.checkpoint.weights import safetensors_files
from phalanx.keras import architecture

__all__ = [
    "FORMAT",
    "load_weights",
    "read_description",
    "save_model",
    "save_weights",
    "summary_lines",
]

FORMAT = "phalanx.model/1"
DESCRIPTION = "model_description"  # a sharded model folder's entry: the description, saved by torch.save


def _class_path(module: nn.Module) -> str:
    cls = architecture.class_of(module)
    return f"{cls.__module__}:{cls.__qualname__}"


def _module_config(module: nn.Module) -> Any:
    get_config = getattr(module, "get_config", None)
    return get_config() if callable(get_config) else None


def _description(model: Any) -> dict[str, Any]:
    """Everything `save_model` writes but the weights and the optimizer state."""
    return {
        "format": FORMAT,
        "module_class": _class_path(model.module),
        "module_config": _module_config(model.module),
        "architecture": architecture.describe(model.module),
        "compile": model.get_compile_config(),
    }


def save_model(model: Any, filepath: str) -> None:
    """Writes `model` to ``filepath`` atomically (all workers call it; the chief's file is
    kept), or as a sharded folder (see `phalanx.checkpoint._sharded_state.writes_sharded`).

    Raises:
        ValueError: ``filepath`` ends in ``.safetensors``, which holds weights only.
    """
    if str(filepath).endswith(safetensors_files.SUFFIX):
        raise ValueError(
            "Model.save writes the architecture, compile settings and optimizer state, which a "
            f"safetensors file cannot hold. Received: {filepath!r}. HINT: model.save_weights(path) "
            "writes the weights as safetensors; model.save(path) with another suffix writes the rest."
        )
    if _sharded_state.writes_sharded(model, filepath):
        description = io.BytesIO()
        torch.save(_description(model), description)  # read back with weights_only=True
        objects = {"model": model.module}
        if model.optimizer is not None:
            objects["optimizer"] = model.optimizer
        state = _sharded_state.collect(objects, model.strategy)
        state["format"], state["save_counter"] = _sharded_state.FORMAT, 0
        state[DESCRIPTION] = description.getvalue()
        _sharded.save(state, filepath)
        return
    payload = {
        **_description(model),
        "weights": model.module.state_dict(),
        "optimizer_state": model.optimizer.state_dict() if model.optimizer is not None else None,
    }
    with chief_path(filepath, model.strategy) as target:
        atomic_save(payload, target)


def read_description(filepath: str) -> dict[str, Any]:
    """What `save_model` wrote of a model in a sharded folder, besides the tensors.

    Raises:
        ValueError: The folder holds no model description (not written by `save_model`).
    """
    state: dict[str, Any] = {"format": "", DESCRIPTION: b""}
    found: dict[str, Any] = {}
    try:
        _sharded.load(state, filepath, found.update)
    except ValueError as exc:  # `_sharded.load`'s, naming a missing key
        if "Missing key" not in str(exc):
            raise
        raise ValueError(f"{filepath!r} is not a phalanx model folder (written by Model.save).") from exc
    payload = torch.load(io.BytesIO(found[DESCRIPTION]), weights_only=True)
    if found["format"] != _sharded_state.FORMAT or payload.get("format") != FORMAT:
        raise ValueError(f"{filepath!r} is not a phalanx model folder (format {FORMAT}).")
    return payload


def save_weights(model: Any, filepath: str) -> None:
    """Writes the wrapped module's state dict (plain tensors) atomically, as a sharded folder
    (see `phalanx.checkpoint._sharded_state.writes_sharded`), or to a ``.safetensors`` file
    (each worker writing its rows)."""
    if str(filepath).endswith(safetensors_files.SUFFIX):
        safetensors_files.save_safetensors(model.module, filepath)
        return
    if _sharded_state.writes_sharded(model, filepath):
        state = _sharded_state.collect({"model": model.module}, model.strategy)
        state["format"], state["save_counter"] = _sharded_state.FORMAT, 0
        _sharded.save(state, filepath)
        return
    state = model.module.state_dict()
    with chief_path(filepath, model.strategy) as target:
        atomic_save(state, target)


def load_weights(model: Any, filepath: str) -> None:
    """Loads a `save_weights` or `save` file (or sharded folder), or a safetensors file or
    Hugging Face folder, into the model (every replica is updated; a sharded model's workers
    read only their rows)."""
    if safetensors_files.is_safetensors(filepath):
        safetensors_files.load_safetensors(model.module, filepath)
        return
    if _sharded.is_sharded(filepath):
        _sharded_state.prepare({"model": model.module}, _sharded.saved_keys(filepath))
        state = _sharded_state.collect({"model": model.module}, model.strategy)
        state["format"] = ""

        def apply(loaded: dict[str, Any]) -> None:
            _sharded_state.apply({"model": model.module}, loaded, model.strategy)

        try:
            _sharded.load(state, filepath, apply)
        except ValueError as exc:  # `_sharded.load`'s, naming a missing key
            if "Missing key" not in str(exc):
                raise
            raise ValueError(
                f"{filepath!r} holds no model weights saved by Model.save or Model.save_weights ({exc}). "
                "HINT: a folder written by phalanx.train.Checkpoint is read with Checkpoint(...).read."
            ) from exc
        return
    payload = safe_load(filepath)
    if isinstance(payload, dict) and payload.get("format") == FORMAT:
        payload = payload["weights"]
    model.module.load_state_dict(payload)


def summary_lines(model: Any) -> Iterator[str]:
    """The lines of `Model.summary`."""
    width = 72
    yield f'Model: "{type(model.module).__name__}"  (strategy: {model.strategy!r})'
    yield "=" * width
    yield f"{'Layer (type)':<48}{'Param #':>24}"
    yield "=" * width
    for name, child in model.module.named_modules():
        if name and not any(True for _ in child.children()):
            count = sum(p.numel() for p in child.parameters(recurse=False))
            yield f"{name + ' (' + type(child).__name__ + ')':<48}{count:>24,}"
    total = sum(p.numel() for p in model.module.parameters())
    trainable = sum(p.numel() for p in model.module.parameters() if p.requires_grad)
    yield "=" * width
    yield f"Total params: {total:,}"
    yield f"Trainable params: {trainable:,}"
    yield f"Non-trainable params: {total - trainable:,}"
