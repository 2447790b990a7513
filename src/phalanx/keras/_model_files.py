"""Writing a model's files and its summary: what `phalanx.keras.Model`'s ``save``,
``save_weights``, ``load_weights`` and ``summary`` call (see `phalanx.keras.saving`, which
re-exports them next to ``load_model``, for the format).

Below model.py, so that the model does not import `saving`, whose ``load_model`` builds a Model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from phalanx.checkpoint._files import atomic_save, chief_path, safe_load
from phalanx.keras import architecture

__all__ = ["FORMAT", "load_weights", "save_model", "save_weights", "summary_lines"]

FORMAT = "phalanx.model/1"


def _class_path(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}:{cls.__qualname__}"


def _module_config(module: nn.Module) -> Any:
    get_config = getattr(module, "get_config", None)
    return get_config() if callable(get_config) else None


def save_model(model: Any, filepath: str) -> None:
    """Writes `model` to ``filepath`` atomically (all workers call it; the chief's file is kept)."""
    payload = {
        "format": FORMAT,
        "module_class": _class_path(model.module),
        "module_config": _module_config(model.module),
        "architecture": architecture.describe(model.module),
        "weights": model.module.state_dict(),
        "compile": model._compile_config or None,
        "optimizer_state": model.optimizer.state_dict() if model.optimizer is not None else None,
    }
    with chief_path(filepath, model.strategy) as target:
        atomic_save(payload, target)


def save_weights(model: Any, filepath: str) -> None:
    """Writes the wrapped module's state dict (plain tensors) atomically."""
    state = model.module.state_dict()
    with chief_path(filepath, model.strategy) as target:
        atomic_save(state, target)


def load_weights(model: Any, filepath: str) -> None:
    """Loads a `save_weights` or `save` file into the model (every replica is updated)."""
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
