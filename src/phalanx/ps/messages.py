"""The messages of a ps task's RPC table (`phalanx.ps.variable_store.store.VariableStore.handlers`), built
and read here so no caller re-implements them: gradients (dense, or sparse as indices and
values), optimizer state (tensor entries apart from the rest) and optimizer classes."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
import torch

if TYPE_CHECKING:
    from phalanx.ps.handles import VariableHandle

__all__ = [
    "MESSAGE_HINT",
    "decode_gradients",
    "decode_optimizer_class",
    "decode_optimizer_state",
    "encode_gradients",
    "encode_optimizer_class",
    "encode_optimizer_state",
    "hyperparameters",
    "optimizer_key",
]

MESSAGE_HINT = (
    "HINT: build messages with phalanx.ps.messages' encode_* helpers; "
    "every task must run the same phalanx version."
)


def encode_gradients(
    names: Sequence[str], grads: Sequence[torch.Tensor]
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header and tensors of an ``apply_gradients`` message (the caller adds ``"key"``).

    Returns:
        ``{"names": [...], "sparse": [positions], "sparse_sizes": {str(position): size}}`` and
        the tensors in the order of ``names``: a dense gradient as one tensor, a sparse (COO)
        one as two, its indices (int64, ``[sparse_dim, nnz]``) then its values.
    """
    sparse: list[int] = []
    sizes: dict[str, list[int]] = {}
    tensors: list[torch.Tensor] = []
    for position, grad in enumerate(grads):
        if grad.is_sparse:
            grad = grad.coalesce()
            sparse.append(position)
            sizes[str(position)] = list(grad.shape)
            tensors += [grad.indices(), grad.values()]
        else:
            tensors.append(grad)
    return {"names": list(names), "sparse": sparse, "sparse_sizes": sizes}, tensors


def decode_gradients(header: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients `encode_gradients` sent, in the order of ``header["names"]``.

    Raises:
        ValueError: The header's sparse positions or the number of tensors do not match, or a
            sparse gradient's indices lie outside its size.
    """
    n = len(header["names"])
    sparse = set(header.get("sparse") or [])
    sizes = header.get("sparse_sizes") or {}
    if (
        not sparse <= set(range(n))
        or {str(p) for p in sparse} != set(sizes)
        or len(tensors) != n + len(sparse)
    ):
        raise ValueError(
            f"An apply_gradients message has one tensor per dense and two per sparse gradient, and a size "
            f"per sparse position. Received: {n} names, sparse positions {sorted(sparse)}, sizes for "
            f"{sorted(sizes)} and {len(tensors)} tensors. {MESSAGE_HINT}"
        )
    grads, i = [], 0
    for position in range(n):
        if position in sparse:  # checked: unchecked indices could write outside the variable
            indices = tensors[i]
            grads.append(
                torch.sparse_coo_tensor(
                    indices,
                    tensors[i + 1],
                    sizes[str(position)],
                    check_invariants=True,  # also refuses a false is_coalesced
                    is_coalesced=_sorted_rows(indices),  # the optimizer's coalesce() is then free
                )
            )
            i += 2
        else:
            grads.append(tensors[i])
            i += 1
    return grads


def _sorted_rows(indices: torch.Tensor) -> bool:
    """Whether one-dimensional sparse indices are strictly increasing (coalesced, as a worker's
    `encode_gradients` sends them): a comparison instead of the sort ``coalesce`` does."""
    if indices.dim() != 2 or indices.shape[0] != 1:
        return False
    return indices.shape[1] < 2 or bool((indices[0, 1:] > indices[0, :-1]).all())


def encode_optimizer_class(optimizer_class: type) -> str:
    """The class as text for a ``create_optimizer`` header (cloudpickle, then base64)."""
    return base64.b64encode(cloudpickle.dumps(optimizer_class)).decode()


def encode_optimizer_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header and tensors of an `VariableStore.optimizer_state` result.

    Returns:
        ``{"groups": [...], "state": {variable: {key: value}}, "tensor_entries": [[variable, key]]}``
        where ``"state"`` keeps the non-tensor entries and ``tensors[i]`` is the value of
        ``tensor_entries[i]``.
    """
    tensors: list[torch.Tensor] = []
    entries: list[list[str]] = []
    plain: dict[str, dict[str, Any]] = {}
    for name, values in state.get("state", {}).items():
        plain[name] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                entries.append([name, key])
                tensors.append(value.detach().cpu())
            else:
                plain[name][key] = value
    header = {"groups": [dict(g) for g in state.get("groups", [])], "state": plain, "tensor_entries": entries}
    return header, tensors


def decode_optimizer_state(header: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The inverse of `encode_optimizer_state`.

    Raises:
        ValueError: The number of tensors differs from the header's tensor entries.
    """
    entries = header.get("tensor_entries") or []
    if len(entries) != len(tensors):
        raise ValueError(
            f"An optimizer state message has one tensor per tensor entry. Received: {len(entries)} entries "
            f"and {len(tensors)} tensors. {MESSAGE_HINT}"
        )
    state = {name: dict(values) for name, values in (header.get("state") or {}).items()}
    for (name, key), tensor in zip(entries, tensors, strict=True):
        state.setdefault(name, {})[key] = tensor
    return {"state": state, "groups": [dict(g) for g in header.get("groups") or []]}


# ---------------------------------------------------------------------- optimizers


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters as they travel with ``create_optimizer`` and each
    ``apply_gradients`` (tensors as numbers, tuples as lists).

    Raises:
        TypeError: A hyperparameter is not JSON-serialisable (named before anything is sent).
    """
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            value = value.item()
        out[key] = list(value) if isinstance(value, tuple) else value
    json.dumps(out)  # fails early, naming nothing sent that the ps could not read
    return out


def optimizer_key(optimizer: torch.optim.Optimizer, groups: Sequence[Sequence[VariableHandle]]) -> str:
    """The optimizer's name on the ps tasks: the same on the chief and on every worker for the
    same optimizer (its class and its variables, by group)."""
    text = type(optimizer).__qualname__ + "|" + "|".join(",".join(h.name for h in g) for g in groups)
    return f"{type(optimizer).__name__}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def decode_optimizer_class(text: str) -> type:
    """The class `encode_optimizer_class` sent (only from an authenticated peer)."""
    cls = cloudpickle.loads(base64.b64decode(text))
    assert isinstance(cls, type)
    return cls
