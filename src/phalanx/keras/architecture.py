"""A model made only of ``torch.nn`` layers and containers, described as data and rebuilt safely.

`describe` turns a module tree into plain data — type names and constructor arguments —
when every module in it is an allow-listed ``torch.nn`` type (Sequential, ModuleList,
ModuleDict and the layers in `ALLOWED_LAYERS`). `build` turns that data back into modules:
it instantiates only allow-listed ``torch.nn`` classes, looked up by name on ``torch.nn``
itself, with arguments that must be plain values and constructor parameter names. It never
imports a module and never resolves a dotted path, so a crafted file can name ``os.system``
or any class it likes: `build` refuses it before anything runs.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["ALLOWED_LAYERS", "CONTAINERS", "ArchitectureError", "build", "class_of", "describe"]

CONTAINERS = frozenset({"Sequential", "ModuleList", "ModuleDict"})
_ACTIVATIONS = """CELU ELU GELU GLU Hardshrink Hardsigmoid Hardswish Hardtanh LeakyReLU LogSigmoid LogSoftmax
    Mish PReLU ReLU ReLU6 SELU SiLU Sigmoid Softmax Softmin Softplus Softshrink Softsign Tanh Tanhshrink
    Threshold"""
_LAYERS = """Identity Linear Bilinear Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d
    MaxPool1d MaxPool2d MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d
    AdaptiveAvgPool3d AdaptiveMaxPool1d AdaptiveMaxPool2d AdaptiveMaxPool3d BatchNorm1d BatchNorm2d
    BatchNorm3d LayerNorm GroupNorm InstanceNorm1d InstanceNorm2d InstanceNorm3d LocalResponseNorm
    Dropout Dropout1d Dropout2d Dropout3d AlphaDropout Embedding EmbeddingBag RNN LSTM GRU Flatten
    Unflatten Upsample ZeroPad1d ZeroPad2d ZeroPad3d ConstantPad1d ConstantPad2d ConstantPad3d
    ReflectionPad1d ReflectionPad2d ReplicationPad1d ReplicationPad2d ReplicationPad3d PixelShuffle
    PixelUnshuffle CosineSimilarity PairwiseDistance"""
ALLOWED_LAYERS = frozenset((_ACTIVATIONS + " " + _LAYERS).split())

# Constructors that take *args/**kwargs: their arguments, as the module stores them.
_RNN_ARGS = ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional")
_EXPLICIT_ARGS: dict[str, tuple[str, ...]] = {
    "RNN": (*_RNN_ARGS, "nonlinearity"),
    "LSTM": (*_RNN_ARGS, "proj_size"),
    "GRU": _RNN_ARGS,
    "Identity": (),
    "Hardtanh": ("min_val", "max_val", "inplace"),  # min_value/max_value: deprecated aliases
}
# Arguments a module keeps under another attribute name.
_ATTRIBUTES: dict[str, dict[str, str]] = {"PairwiseDistance": {"p": "norm"}}
_NOT_ARGUMENTS = frozenset({"device", "dtype"})
_PLAIN = (bool, int, float, str, type(None))


class ArchitectureError(ValueError):
    """A described architecture that `build` refuses (not allow-listed, or not plain data)."""


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    return isinstance(value, _PLAIN)


def _argument_names(cls: type[nn.Module]) -> tuple[str, ...]:
    if cls.__name__ in _EXPLICIT_ARGS:
        return _EXPLICIT_ARGS[cls.__name__]
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return tuple(
        p.name
        for p in parameters
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in _NOT_ARGUMENTS
        and not p.name.startswith("_")
    )


def _layer_config(module: nn.Module) -> dict[str, Any] | None:
    config: dict[str, Any] = {}
    cls = class_of(module)
    renamed = _ATTRIBUTES.get(cls.__name__, {})
    for name in _argument_names(cls):
        attribute = renamed.get(name, name)
        if not hasattr(module, attribute):
            return None  # an argument the module does not keep: not describable
        value = getattr(module, attribute)
        if name == "bias" and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None  # the module keeps the parameter; the constructor takes a flag
        if not _plain(value):
            return None
        config[name] = value
    return config


def class_of(module: nn.Module) -> type[nn.Module]:
    """The module's own class: under FullyShardedStrategy, the class FSDP2's ``fully_shard``
    derived from (it gives a sharded module a class ``FSDP<Name>(FSDPModule, <Name>)``)."""
    cls = type(module)
    if isinstance(module, FSDPModule):
        for base in cls.__bases__:
            if base is not FSDPModule and issubclass(base, nn.Module):
                return base
    return cls


def _torch_nn_name(module: nn.Module) -> str | None:
    cls = class_of(module)
    # Only the class torch.nn exports under that name counts, never a subclass or a look-alike.
    return cls.__name__ if getattr(nn, cls.__name__, None) is cls else None


def describe(module: nn.Module) -> dict[str, Any] | None:
    """The module tree as plain data, or None if any module in it is not an allow-listed torch.nn type."""
    name = _torch_nn_name(module)
    if name in CONTAINERS:
        children = []
        for child_name, child in module.named_children():
            node = describe(child)
            if node is None:
                return None
            children.append((child_name, node))
        return {"class_name": name, "children": children}
    if name not in ALLOWED_LAYERS or any(True for _ in module.children()):
        return None
    config = _layer_config(module)
    return None if config is None else {"class_name": name, "config": config}


def _refuse(rule: str, received: Any) -> ArchitectureError:
    return ArchitectureError(
        f"The model file's architecture is not one phalanx rebuilds: {rule}. Received: {received!r}. "
        "HINT: build the module yourself and pass it: phalanx.load_model(path, module=MyNet())."
    )


def _allowed_class(name: Any) -> type[nn.Module]:
    if not isinstance(name, str) or name not in ALLOWED_LAYERS | CONTAINERS:
        raise _refuse("only allow-listed torch.nn layers and containers are instantiated", name)
    cls: type[nn.Module] = getattr(nn, name)  # an allow-listed name: a torch.nn class
    return cls


def build(node: Any) -> nn.Module:
    """Instantiates a `describe` result (weights are loaded separately).

    Raises:
        ArchitectureError: A type outside the allow-list, an argument that is not a
            constructor parameter or not plain data, or a malformed node.
    """
    if not isinstance(node, dict):
        raise _refuse("each node is a dict", type(node).__name__)
    cls = _allowed_class(node.get("class_name"))
    if cls.__name__ in CONTAINERS:
        children = node.get("children")
        if not isinstance(children, list) or not all(
            isinstance(c, (tuple, list)) and len(c) == 2 and isinstance(c[0], str) for c in children
        ):
            raise _refuse("a container's children are (name, node) pairs", children)
        built = OrderedDict((name, build(child)) for name, child in children)
        return cls(list(built.values())) if cls is nn.ModuleList else cls(built)
    config = node.get("config")
    if not isinstance(config, dict):
        raise _refuse("a layer's config is a dict", config)
    allowed = set(_argument_names(cls))
    for key, value in config.items():
        if key not in allowed or not _plain(value):
            raise _refuse(f"{cls.__name__}'s arguments are {sorted(allowed)} with plain values", {key: value})
    return cls(**config)
