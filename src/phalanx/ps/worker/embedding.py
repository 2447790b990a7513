"""Row-wise lookups of sharded embedding tables on a worker.

The weight of an ``nn.Embedding`` that a partitioner split over the ps tasks is never read
whole by a worker: when the module runs forward inside a scheduled function, the rows its
input asks for are fetched from the shards that hold them (`PSClient.read_rows`), the lookup
is made on that small table, and ``optimizer.step()`` sends the small table's gradient back
as a sparse gradient of the whole weight (the ps tasks apply it; optimizers without sparse
support get it as a dense gradient, which gives the same update). `nn.Embedding`'s own forward
is given no ids meanwhile: its lookup in the local copy of the whole table would be thrown away
(a subclass's forward still gets them). A module other than the embedding that uses the same
weight (tied weights) makes the worker read it whole.

The hooks are global torch module hooks, installed by the worker's environment through
`phalanx._hooks` (removed with phalanx's other changes to torch once no strategy is alive);
they act only while a scheduled function runs.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from phalanx import _hooks
from phalanx.ps.worker import context

__all__ = ["install", "sparse_gradient"]

# the ids a lazy table's forward was called with, by id(module), from its pre-hook to its hook:
# the module's own forward gets none (its whole-table lookup would be thrown away)
_held = threading.local()
_EMBEDDING_FORWARD = torch.nn.Embedding.forward  # a subclass's own forward gets the ids, as before


def install() -> None:
    """Installs the two global hooks (idempotent)."""
    _hooks.add_module_forward_hooks(_before_forward, _after_forward)


def _before_forward(module: torch.nn.Module, args: Any) -> tuple[Any, ...] | None:
    env = context.current()
    if env is None or not env.lazy:
        return None
    for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
        if not env.is_lazy(param):
            continue
        if not (isinstance(module, torch.nn.Embedding) and name == "weight"):
            env.read_whole(param)  # another module uses the table itself
        elif args and isinstance(args[0], torch.Tensor) and type(module).forward is _EMBEDDING_FORWARD:
            held = _held.__dict__.setdefault("ids", {})
            held[id(module)] = args[0]
            return (args[0][:0], *args[1:])  # `_after_forward` looks the ids up by rows
    return None


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> Any:
    env = context.current()
    if env is None or not isinstance(module, torch.nn.Embedding) or not env.is_lazy(module.weight):
        return None
    if module.max_norm is not None:
        raise NotImplementedError(
            "nn.Embedding(max_norm=...) renormalizes rows of the whole table in place, which a "
            "sharded table on the ps tasks cannot do. HINT: drop max_norm, or do not partition it."
        )
    ids = _held.__dict__.get("ids", {}).pop(id(module), args[0])
    unique, inverse = torch.unique(ids, return_inverse=True)
    rows = env.lookup_rows(module.weight, unique)
    if torch.is_grad_enabled() and module.weight.requires_grad:
        rows.requires_grad_(True)
    padding = None
    if module.padding_idx is not None:
        hit = (unique == module.padding_idx).nonzero().flatten()
        padding = int(hit[0]) if hit.numel() else None
    return torch.nn.functional.embedding(inverse, rows, padding, None, 2.0, module.scale_grad_by_freq, False)


def sparse_gradient(
    shape: tuple[int, ...], lookups: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor | None:
    """The whole table's gradient (sparse COO) from the rows' gradients of its lookups."""
    indices, values = [], []
    for unique, rows in lookups:
        if rows.grad is not None:
            indices.append(unique)
            values.append(rows.grad)
    if not indices:
        return None
    if len(indices) == 1:  # one lookup's rows come from torch.unique: sorted, each once (coalesced)
        return torch.sparse_coo_tensor(
            indices[0][None], values[0], shape, check_invariants=False, is_coalesced=True
        )
    coo = torch.sparse_coo_tensor(torch.cat(indices)[None], torch.cat(values), shape, check_invariants=False)
    return coo.coalesce()
