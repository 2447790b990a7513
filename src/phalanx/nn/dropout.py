"""Replica-count-invariant dropout: the seed rule for `nn.Dropout` under a strategy.

Inside ``strategy.run`` the mask element for global example ``j``, feature ``f`` is a hash
of (``torch.initial_seed()``, the strategy's step counter, the replica's dropout-call index,
``j``, ``f``). Every replica therefore draws exactly the mask rows a single device would
draw for the same global batch, and a model trained with dropout gives the same numbers
under OneDevice, Mirrored with 2 or 4 replicas, or several workers. Applied to
``torch.nn.Dropout`` modules created inside a strategy scope; other dropout variants use
torch's generator as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx import context

__all__ = ["attach_keyed_dropout", "keyed_dropout_mask"]

_KEYED_MARK = "_phalanx_keyed"  # module.__dict__ key: the keyed-dropout hook is registered
_MASK31 = (1 << 31) - 1
_C1 = 0xFF51AFD7ED558CCD - (1 << 64)
_C2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _mix(x: torch.Tensor) -> torch.Tensor:
    # murmur3's 64-bit finaliser; masked shifts make arithmetic shifts behave as logical ones
    x = x ^ ((x >> 33) & _MASK31)
    x = x * _C1
    x = x ^ ((x >> 33) & _MASK31)
    x = x * _C2
    return x ^ ((x >> 33) & _MASK31)


def keyed_dropout_mask(
    shape: torch.Size, p: float, key: int, first_example: int, device: torch.device
) -> torch.Tensor:
    """The keep-mask (bool) of a batch whose first row is global example ``first_example``."""
    rows = shape[0]
    features = shape[1:].numel() if len(shape) > 1 else 1
    j = torch.arange(first_example, first_example + rows, dtype=torch.int64, device=device)
    f = torch.arange(features, dtype=torch.int64, device=device)
    index = j[:, None] * features + f[None, :]
    bits = _mix(index * _GOLDEN + key)
    uniform = (bits & ((1 << 24) - 1)).to(torch.float32) / float(1 << 24)
    return (uniform >= p).reshape(shape)


def _keyed_dropout(module: nn.Dropout, args: tuple[Any, ...], output: torch.Tensor) -> Any:
    replica = context.current_replica()
    if replica is None or not module.training or module.p == 0.0:
        return None
    strategy, index = replica
    ctx = strategy.replica_context(index) if not strategy.is_default else None
    if ctx is None:
        return None
    x = args[0]
    if x.dim() == 0 or x.shape[0] == 0:
        return None
    call = ctx.next_dropout_call()
    key = hash((torch.initial_seed(), strategy.run_count, call)) & ((1 << 62) - 1)
    keep = keyed_dropout_mask(x.shape, module.p, key, ctx.example_offset, x.device)
    if module.p >= 1.0:
        return x * 0.0
    return x * keep.to(x.dtype) / (1.0 - module.p)


def attach_keyed_dropout(module: nn.Module) -> None:
    """Makes an `nn.Dropout` follow the seed rule above (idempotent)."""
    if type(module) is nn.Dropout and not module.__dict__.get(_KEYED_MARK, False):
        module.register_forward_hook(_keyed_dropout)
        # phalanx's mark in the module's __dict__: a deep copy carries it with the hook
        module.__dict__[_KEYED_MARK] = True
