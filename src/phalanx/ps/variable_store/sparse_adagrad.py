"""Adagrad's update of a table from a row gradient, without torch's sparse tensors.

A ps task applies an embedding's gradient (a coalesced COO tensor of the rows a step looked
up) with ``torch.optim.Adagrad``, whose sparse path builds three sparse tensors, a
``sparse_mask`` and two sparse-into-dense ``add_`` per push: most of a small embedding step's
time on the ps (docs/performance.md, parameter server). `apply_rows` computes the same thing on the
looked-up rows only, with dense kernels (``index_select``, ``index_put_``),
bit for bit what torch's `_single_tensor_adagrad` writes (`tests/unit/ps/test_sparse_adagrad.py`
checks it against torch for the cases `takes` accepts). Anything else (other optimizers, weight
decay, ``maximize``, ``differentiable``, ``fused``, complex tables, a gradient that
is not one coalesced row index) stays with torch's ``step``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from phalanx import _hooks

__all__ = ["apply_rows", "step_hooks", "step_without_hooks", "takes"]


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer``'s ``step`` without torch's hook-and-profiling wrapper (None: not found)."""
    return getattr(type(optimizer).step, "__wrapped__", None)


@contextlib.contextmanager
def step_hooks(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Runs ``optimizer``'s step pre-hooks before the block and its post-hooks after it (the
    global ones and its own, in torch's order), as ``optimizer.step()`` runs them."""
    for hook in _hooks.optimizer_step_hooks(optimizer)[0]:
        hook(optimizer, (), {})
    yield
    for hook in _hooks.optimizer_step_hooks(optimizer)[1]:  # read after the step, as torch does
        hook(optimizer, (), {})


def step_without_hooks(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` inside `step_hooks` (which ran the hooks already)."""
    _unhooked_step(optimizer)(optimizer)


def takes(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], variable: torch.Tensor, grad: torch.Tensor
) -> bool:
    """Whether `apply_rows` computes this update exactly as ``optimizer.step()`` would."""
    if type(optimizer) is not torch.optim.Adagrad or not grad.is_sparse or _unhooked_step(optimizer) is None:
        return False
    if any(group.get(option) for option in ("weight_decay", "maximize", "differentiable", "fused")):
        return False
    state = optimizer.state.get(variable) or {}
    if not all(isinstance(state.get(key), torch.Tensor) for key in ("step", "sum")):
        return False
    return (
        grad.is_coalesced()
        and grad.sparse_dim() == 1
        and grad.shape == variable.shape
        and grad.dtype == variable.dtype
        and variable.layout == torch.strided
        and not variable.is_complex()
        and variable.device.type == "cpu"
        and state["sum"].shape == variable.shape
        and state["sum"].dtype == variable.dtype
    )


def apply_rows(
    group: Mapping[str, Any], state: Mapping[str, torch.Tensor], variable: torch.Tensor, grad: torch.Tensor
) -> None:
    """One Adagrad step of ``variable`` on the rows of ``grad`` (a coalesced row gradient),
    with ``group``'s hyperparameters and ``state`` (``step``, ``sum``), as torch's sparse path:
    ``sum[rows] += g**2``, ``variable[rows] -= clr * g / (sqrt(sum[rows]) + eps)``."""
    lr = group["lr"]
    lr = lr.item() if isinstance(lr, torch.Tensor) else lr
    with torch.no_grad():
        step_t = state["step"]
        step_t += 1
        step = step_t.item()
        clr = lr / (1 + (step - 1) * group["lr_decay"])
        rows, values = grad.indices()[0], grad.values()  # views: `takes` checked it is coalesced
        sums = state["sum"]
        updated = sums.index_select(0, rows).add_(values.pow(2))  # (nnz, *row shape)
        sums.index_put_((rows,), updated)
        std = updated.sqrt_().add_(group["eps"])
        # gathered, stepped and written back: torch's sparse add_ rounds as add_(alpha=...) does
        stepped = variable.index_select(0, rows).add_(values / std, alpha=-clr)
        variable.index_put_((rows,), stepped)
