"""``phalanx.saved_model``: a serving artifact that runs without the model's Python class (tf.saved_model).

`save` traces the model with ``torch.export`` on example inputs and writes the resulting
program — the graph and the weights — with ``torch.export.save`` (a ``.pt2`` archive).
`load` reads it back with ``torch.export.load`` and returns a module that computes the same
outputs; the model's class and the module that defined it are never needed, so a serving
process can load the artifact without the training code.

The batch axis (axis 0 of every tensor input) stays dynamic by default, as a TF serving
signature's ``None`` batch dimension.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from phalanx.checkpoint._files import chief_path

__all__ = ["FILENAME", "load", "save"]

FILENAME = "saved_model.pt2"


def _artifact_path(path: str | os.PathLike[str]) -> str:
    """``path`` itself when it names a ``.pt2`` file, else ``<path>/saved_model.pt2`` (TF's export dir)."""
    text = os.fspath(path)
    return text if text.endswith(".pt2") else os.path.join(text, FILENAME)


def _plain_module(model: Any) -> nn.Module:
    """A copy of the model's module with plain tensors: distributed variables read outside `run`."""
    module = getattr(model, "module", model)
    if not isinstance(module, nn.Module):
        raise TypeError(
            "phalanx.saved_model.save exports a torch.nn.Module or a phalanx.Model. Received: "
            f"{type(model).__name__}. HINT: wrap the computation in an nn.Module."
        )
    plain = copy.deepcopy(module)
    plain.load_state_dict(module.state_dict())  # the aggregated values of sync-on-read buffers
    return plain.eval()


def _batch_of_two(example_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Inputs with a batch of 1 repeated to 2: torch.export would fix a size-1 axis to 1."""

    def widen(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 1:
            return value.expand(2, *value.shape[1:]).clone()
        return value

    return tuple(widen(value) for value in example_inputs)


def _batch_dynamic_shapes(example_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return {0: torch.export.Dim.AUTO}
        return None

    return tuple(spec(value) for value in example_inputs)


def save(
    model: Any,
    path: str | os.PathLike[str],
    example_inputs: tuple[Any, ...] | torch.Tensor,
    dynamic_batch: bool = True,
) -> str:
    """Exports ``model`` for serving (every worker may call it; the chief's file is kept).

    The model runs once per traced branch on ``example_inputs`` in eval mode (dropout off,
    BatchNorm on its running statistics); the export holds the weights as they are now.

    Args:
        model: A `phalanx.Model` or a torch module (made in a strategy scope or not).
        path: A directory (the artifact is ``<path>/saved_model.pt2``, as TF's export dir)
            or a file name ending in ``.pt2``.
        example_inputs: The positional inputs of one forward call (a tensor or a tuple).
        dynamic_batch: Keep axis 0 of every tensor input dynamic, so any batch size serves.

    Returns:
        The path of the written ``.pt2`` file.

    Raises:
        TypeError: ``model`` is not a module.
        torch._dynamo.exc.UserError: ``torch.export`` cannot capture the forward pass
            (data-dependent Python control flow; see the torch.export documentation).
    """
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    plain = _plain_module(model)
    if dynamic_batch:
        inputs = _batch_of_two(inputs)
    shapes = _batch_dynamic_shapes(inputs) if dynamic_batch else None
    with torch.no_grad():
        program = torch.export.export(plain, inputs, dynamic_shapes=shapes, strict=False)
    target = _artifact_path(path)
    from phalanx.strategies.default import get_strategy  # here: serving imports no strategy

    strategy = getattr(model, "strategy", None) or get_strategy()
    with chief_path(target, strategy) as write_to:
        os.makedirs(os.path.dirname(os.path.abspath(write_to)), exist_ok=True)
        partial = f"{write_to[: -len('.pt2')]}.partial.pt2"  # torch.export.save wants the suffix
        torch.export.save(program, partial)
        os.replace(partial, write_to)  # readers never see half a file
    return target


def load(path: str | os.PathLike[str]) -> nn.Module:
    """Reads an artifact written by `save`: a module computing the saved model's outputs.

    Needs neither the model's class nor phalanx's strategies: only torch.

    Args:
        path: What was given to `save` (the directory or the ``.pt2`` file).

    Raises:
        FileNotFoundError: No artifact at ``path``.
    """
    target = _artifact_path(path)
    if not os.path.isfile(target):
        raise FileNotFoundError(
            f"No saved model at {target!r}. HINT: pass the directory or .pt2 file given to "
            "phalanx.saved_model.save."
        )
    return torch.export.load(target).module()
