"""Saving and loading phalanx models without unpickling arbitrary objects.

A saved model holds plain data only (read back with ``torch.load(weights_only=True)``):
the module's class as ``"module:QualName"`` and its config (from ``get_config()`` if the
class has one), the architecture as data when the model is made only of ``torch.nn``
layers and containers (`phalanx.keras.architecture`), the weights, the compile
configuration and the optimizer state.

Loading rebuilds such a model without its class, instantiating only allow-listed
``torch.nn`` types. Any other class is found in ``custom_objects`` or in an *already
imported* module, or the caller passes ``module=`` — loading never imports or executes
anything named by the file.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from phalanx.checkpoint._files import safe_load
from phalanx.checkpoint._sharded import is_sharded
from phalanx.checkpoint.checkpoint import Checkpoint
from phalanx.keras import architecture, optimizers
from phalanx.keras._model_files import (
    FORMAT,
    load_weights,
    read_description,
    save_model,
    save_weights,
    summary_lines,
)
from phalanx.keras.compile_utils import rebuild
from phalanx.strategies.default import get_strategy

__all__ = ["load_model", "load_weights", "save_model", "save_weights", "summary_lines"]


def _find_class(path: str, custom_objects: dict[str, Any]) -> type[nn.Module]:
    module_name, _, qualname = path.partition(":")
    for key in (path, qualname, qualname.rsplit(".", 1)[-1]):
        if key in custom_objects:
            return custom_objects[key]
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None) if found is not None else None
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        name = qualname.rsplit(".", 1)[-1] or "MyNet"
        raise ValueError(
            "load_model rebuilds a model without its class only when it is made of torch.nn layers "
            "and containers; any other class must be given, as phalanx never imports code named by a "
            f"file. Received: module class {path!r}, not in custom_objects and not imported. HINT: "
            f"pass the module: phalanx.load_model(path, module={name}()), or "
            f"custom_objects={{'{name}': {name}}}."
        )
    return found


def _build_module(payload: dict[str, Any], custom_objects: dict[str, Any]) -> nn.Module:
    if payload.get("architecture") is not None:
        return architecture.build(payload["architecture"])
    cls = _find_class(payload["module_class"], custom_objects)
    config = payload.get("module_config")
    if config is None:
        return cls()
    from_config = getattr(cls, "from_config", None)
    return from_config(config) if callable(from_config) else cls(**config)


def load_model(
    filepath: str,
    custom_objects: dict[str, Any] | None = None,
    module: nn.Module | None = None,
    compile: bool = True,
) -> Any:
    """Rebuilds a model saved with `Model.save` under the current strategy.

    Call it inside ``strategy.scope()`` to load the model for that strategy (weights saved
    under any strategy load under any other). A model made only of ``torch.nn`` layers and
    containers (``nn.Sequential`` of ``nn.Linear``, ...) is rebuilt from the file without
    its class; any other class comes from ``module=``, ``custom_objects`` or an imported module.

    Args:
        filepath: The saved file.
        custom_objects: Classes by name, for module classes not importable by path.
        module: An instance to load the weights into, instead of rebuilding the class.
        compile: Restore the optimizer, loss and metrics (and optimizer state).

    Raises:
        ValueError: Not a phalanx model file, or the module class cannot be found (the
            error's HINT: pass ``module=``).
        phalanx.keras.architecture.ArchitectureError: The file's architecture names a type
            outside the allow-list (a crafted file); nothing is imported or run.
    """
    from phalanx import losses, metrics
    from phalanx.keras.model import Model

    folder = is_sharded(filepath)
    payload = read_description(filepath) if folder else safe_load(filepath)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{filepath!r} is not a phalanx model file (format {FORMAT}).")
    with get_strategy().scope():
        net = module if module is not None else _build_module(payload, custom_objects or {})
        if not folder:
            net.load_state_dict(payload["weights"])
        model = Model(net)
    config = payload.get("compile")
    if folder and not (compile and config):  # each worker reads what its tensors hold
        load_weights(model, filepath)
    if compile and config:
        with model.strategy.scope():
            optimizer = optimizers.from_config(config["optimizer"], model.parameters())
        model.compile(
            optimizer=optimizer,
            loss=rebuild(config["loss"], losses),
            metrics=rebuild(config["metrics"], metrics),
            loss_weights=config.get("loss_weights"),
            jit_compile=bool(config.get("jit_compile")),
            gradient_accumulation_steps=config.get("gradient_accumulation_steps"),
        )
        if folder:  # weights and optimizer state, each worker what its tensors hold
            Checkpoint(model=net, optimizer=optimizer).read(filepath)
        elif payload.get("optimizer_state") is not None:
            optimizer.load_state_dict(payload["optimizer_state"])
    return model
