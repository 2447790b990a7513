"""What a ps task holds: its variables, and the optimizers that update them.

Workers read variables and push gradients; each push is applied by a real ``torch.optim``
optimizer over this task's variables (its state lives here), atomically: pushes from
different workers never interleave. `VariableStore.handlers` is the RPC table a
`phalanx.ps.transport.RpcServer` serves; the ``encode_*``/``decode_*`` helpers build and
read its messages on the client side.
"""

from __future__ import annotations

import base64
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle
import torch

__all__ = [
    "VariableStore",
    "decode_gradients",
    "decode_optimizer_state",
    "encode_gradients",
    "encode_optimizer_class",
    "encode_optimizer_state",
]

Handler = Callable[[dict[str, Any], list[torch.Tensor]], tuple[dict[str, Any], list[torch.Tensor]]]
_CREATE_HINT = "HINT: create the model and the optimizer in strategy.scope() on the coordinator."


# ---------------------------------------------------------------------- message encodings
def encode_gradients(
    names: Sequence[str], grads: Sequence[torch.Tensor]
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``{"names": [...], "sparse": {position: size}}`` and the tensors: a dense gradient is one
    tensor, a sparse (COO) one two (indices [ndim, nnz] int64, values)."""
    sparse: dict[str, list[int]] = {}
    tensors: list[torch.Tensor] = []
    for position, grad in enumerate(grads):
        if grad.is_sparse:
            grad = grad.coalesce()
            sparse[str(position)] = list(grad.shape)
            tensors += [grad.indices(), grad.values()]
        else:
            tensors.append(grad)
    return {"names": list(names), "sparse": sparse}, tensors


def decode_gradients(header: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients `encode_gradients` sent, in order."""
    grads, i = [], 0
    sparse = header.get("sparse") or {}
    for position in range(len(header["names"])):
        size = sparse.get(str(position))
        if size is None:
            grads.append(tensors[i])
            i += 1
        else:
            # indices from the network: checked, an out-of-range one must not reach a kernel
            grads.append(torch.sparse_coo_tensor(tensors[i], tensors[i + 1], size, check_invariants=True))
            i += 2
    return grads


def encode_optimizer_class(optimizer_class: type) -> str:
    """The class as text for a ``create_optimizer`` header (cloudpickle, base64)."""
    return base64.b64encode(cloudpickle.dumps(optimizer_class)).decode()


def encode_optimizer_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``{"state": {variable: {key: value}}, "groups": [...]}`` as a header and tensors: each
    tensor value becomes ``{"tensor": index}``, other values stay."""
    tensors: list[torch.Tensor] = []
    encoded: dict[str, dict[str, Any]] = {}
    for name, entries in state.get("state", {}).items():
        encoded[name] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                encoded[name][key] = {"tensor": len(tensors)}
                tensors.append(value.detach().cpu())
            else:
                encoded[name][key] = value
    return {"state": encoded, "groups": list(state.get("groups", []))}, tensors


def decode_optimizer_state(header: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The inverse of `encode_optimizer_state`."""
    state = {
        name: {
            k: tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v
            for k, v in entries.items()
        }
        for name, entries in header.get("state", {}).items()
    }
    return {"state": state, "groups": list(header.get("groups", []))}


def _tuple_defaults(optimizer_class: type) -> set[str]:
    try:
        parameters = inspect.signature(optimizer_class).parameters
    except (TypeError, ValueError):
        return set()
    return {name for name, p in parameters.items() if isinstance(p.default, tuple)}


# ---------------------------------------------------------------------- the store
class _Optimizer:
    """An optimizer over some of this task's variables; groups without any stay placeholders."""

    def __init__(
        self, optimizer_class: type, groups: Sequence[Mapping[str, Any]], tensors: dict[str, torch.Tensor]
    ):
        self.cls = optimizer_class
        self.names = [list(g["names"]) for g in groups]
        self.hyper = [{k: v for k, v in g.items() if k != "names"} for g in groups]
        self.real = [i for i, names in enumerate(self.names) if names]  # group -> index in torch's
        self.members = {name for names in self.names for name in names}
        self.torch: torch.optim.Optimizer | None = None
        if self.real:
            param_groups = [
                {"params": [tensors[n] for n in self.names[i]], **self.hyper[i]} for i in self.real
            ]
            self.torch = optimizer_class(param_groups)

    def takes_sparse(self) -> bool:
        """Whether torch applies sparse gradients with this optimizer exactly as dense ones
        (SparseAdam; Adagrad; SGD without momentum and weight decay)."""
        if issubclass(self.cls, (torch.optim.SparseAdam, torch.optim.Adagrad)):
            return True
        if issubclass(self.cls, torch.optim.SGD):
            return all(not h.get("momentum", 0) and not h.get("weight_decay", 0) for h in self.hyper)
        return False

    def set_hyperparameters(self, hyperparameters: Sequence[Mapping[str, Any]], task: str) -> None:
        if len(hyperparameters) != len(self.names):
            raise ValueError(
                f"The optimizer on {task} has {len(self.names)} param groups; hyperparameters came for "
                f"{len(hyperparameters)}."
            )
        tuples = _tuple_defaults(self.cls)
        for i, hyper in enumerate(hyperparameters):
            converted = {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in hyper.items()}
            self.hyper[i].update(converted)
            if self.torch is not None and i in self.real:
                group = self.torch.param_groups[self.real.index(i)]
                unknown = sorted(set(converted) - set(group))
                if unknown:
                    raise ValueError(f"{self.cls.__name__} has no hyperparameters {unknown}.")
                group.update(converted)


class VariableStore:
    """The variables of one ps task and the optimizers that update them. Thread-safe.

    Args:
        task_name: This task, for messages (e.g. ``"ps:0 (host:2222)"``).
    """

    def __init__(self, task_name: str = "ps:0") -> None:
        self.task_name = task_name
        self._vars: dict[str, torch.Tensor] = {}
        self._optimizers: dict[str, _Optimizer] = {}
        self._version = 0
        self._lock = threading.RLock()

    def _get(self, name: str) -> torch.Tensor:
        try:
            return self._vars[name]
        except KeyError:
            raise KeyError(f"{self.task_name} has no variable {name!r}. {_CREATE_HINT}") from None

    def _check_like(self, name: str, current: torch.Tensor, value: torch.Tensor) -> None:
        if value.shape != current.shape or value.dtype != current.dtype:
            raise ValueError(
                f"Variable {name!r} on {self.task_name} is {current.dtype} {tuple(current.shape)}; received "
                f"{value.dtype} {tuple(value.shape)}."
            )

    def _bump(self) -> int:
        self._version += 1
        return self._version

    # ------------------------------------------------------------------ variables
    def create(self, name: str, value: torch.Tensor, *, overwrite: bool = False) -> None:
        """Stores a copy of ``value`` as ``name`` (idempotent for the same dtype and shape).

        Raises:
            ValueError: ``name`` exists with another dtype or shape.
        """
        with self._lock:
            current = self._vars.get(name)
            if current is not None:
                self._check_like(name, current, value)
                if overwrite:
                    current.copy_(value)
                    self._bump()
                return
            self._vars[name] = value.detach().to("cpu", copy=True).contiguous()
            self._bump()

    def read(self, names: Sequence[str]) -> list[torch.Tensor]:
        """Copies of the values of ``names``, in order."""
        with self._lock:
            return [self._get(n).clone() for n in names]

    def read_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows of ``name`` along dim 0 (an embedding lookup)."""
        with self._lock:
            table = self._get(name)
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= table.shape[0]):
                bad = int(rows.max()) if int(rows.max()) >= table.shape[0] else int(rows.min())
                raise IndexError(
                    f"Variable {name!r} on {self.task_name} has {table.shape[0]} rows; asked for row {bad}."
                )
            return table.index_select(0, rows.long())

    def assign(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> int:
        """Writes ``values``; returns the new version."""
        with self._lock:
            for name, value in zip(names, values, strict=True):
                current = self._get(name)
                self._check_like(name, current, value)
                current.copy_(value)
            return self._bump()

    def assign_add(self, names: Sequence[str], deltas: Sequence[torch.Tensor]) -> int:
        """Adds ``deltas``; returns the new version."""
        with self._lock:
            for name, delta in zip(names, deltas, strict=True):
                current = self._get(name)
                self._check_like(name, current, delta)
                current.add_(delta)
            return self._bump()

    def version(self) -> int:
        """A counter that grows with every write."""
        return self._version

    def names(self) -> list[str]:
        """The variables' names."""
        with self._lock:
            return list(self._vars)

    # ------------------------------------------------------------------ optimizers
    def create_optimizer(
        self,
        key: str,
        optimizer_class: type[torch.optim.Optimizer],
        groups: Sequence[Mapping[str, Any]],
        *,
        overwrite: bool = False,
    ) -> None:
        """Makes optimizer ``key`` over this task's variables (see the module docstring).

        ``groups``: per param group ``{"names": [...], **hyperparameters}``. The same key again
        is idempotent for the same class and variables (hyperparameters are updated).
        """
        with self._lock:
            for group in groups:
                for name in group["names"]:
                    self._get(name)
            tuples = _tuple_defaults(optimizer_class)
            groups = [
                {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in g.items()}
                for g in groups
            ]
            existing = self._optimizers.get(key)
            if existing is not None and not overwrite:
                if (
                    existing.cls is not optimizer_class
                    and existing.cls.__qualname__ != optimizer_class.__qualname__
                ):
                    raise ValueError(f"Optimizer {key!r} on {self.task_name} is a {existing.cls.__name__}.")
                if existing.names != [list(g["names"]) for g in groups]:
                    raise ValueError(f"Optimizer {key!r} on {self.task_name} has other variables.")
                existing.set_hyperparameters(
                    [{k: v for k, v in g.items() if k != "names"} for g in groups], self.task_name
                )
                return
            self._optimizers[key] = _Optimizer(optimizer_class, groups, self._vars)

    def _optimizer(self, key: str) -> _Optimizer:
        try:
            return self._optimizers[key]
        except KeyError:
            raise KeyError(f"{self.task_name} has no optimizer {key!r}. {_CREATE_HINT}") from None

    def apply_gradients(
        self,
        key: str,
        names: Sequence[str],
        grads: Sequence[torch.Tensor],
        hyperparameters: Sequence[Mapping[str, Any]] | None = None,
    ) -> int:
        """One atomic optimizer step with the gradients of ``names``; others do not change."""
        with self._lock:
            optimizer = self._optimizer(key)
            for name, grad in zip(names, grads, strict=True):
                if name not in optimizer.members:
                    raise ValueError(
                        f"Variable {name!r} is not updated by optimizer {key!r} on {self.task_name}."
                    )
                self._check_like(name, self._vars[name], grad)
            if hyperparameters is not None:
                optimizer.set_hyperparameters(hyperparameters, self.task_name)
            if optimizer.torch is None or not names:
                return self._version
            tensors = [self._vars[n] for n in names]
            dense = not optimizer.takes_sparse()
            for tensor, grad in zip(tensors, grads, strict=True):
                # a sparse gradient is the dense one's nonzero rows: the same update either way
                tensor.grad = grad.to_dense() if dense and grad.is_sparse else grad
            try:
                with torch.no_grad():
                    optimizer.torch.step()
            finally:
                for tensor in tensors:
                    tensor.grad = None
            return self._bump()

    def optimizer_state(self, key: str) -> dict[str, Any]:
        """``{"state": {variable: {key: value}}, "groups": [hyperparameters]}`` (copies)."""
        with self._lock:
            optimizer = self._optimizer(key)
            state: dict[str, dict[str, Any]] = {}
            if optimizer.torch is not None:
                for names in optimizer.names:
                    for name in names:
                        entries = optimizer.torch.state.get(self._vars[name])
                        if entries:
                            state[name] = {
                                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()
                            }
            return {"state": state, "groups": [dict(h) for h in optimizer.hyper]}

    def load_optimizer_state(self, key: str, state: Mapping[str, Any]) -> None:
        """Restores what `optimizer_state` gave."""
        with self._lock:
            optimizer = self._optimizer(key)
            if state.get("groups"):
                optimizer.set_hyperparameters(state["groups"], self.task_name)
            if optimizer.torch is None:
                return
            for name, entries in state.get("state", {}).items():
                if name not in optimizer.members:
                    raise ValueError(
                        f"Variable {name!r} is not updated by optimizer {key!r} on {self.task_name}."
                    )
                optimizer.torch.state[self._vars[name]] = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()
                }
            self._bump()

    # ------------------------------------------------------------------ RPC table
    def handlers(self) -> dict[str, Handler]:
        """The RPC methods (header, tensors) -> (header, tensors): ``create``, ``read``,
        ``read_if_newer``, ``read_rows``, ``assign``, ``assign_add``, ``version``, ``names``,
        ``create_optimizer``, ``apply_gradients`` (see `encode_gradients`),
        ``optimizer_state`` / ``load_optimizer_state`` (see `encode_optimizer_state`)."""

        def create(h: dict[str, Any], t: list[torch.Tensor]) -> Any:
            with self._lock:
                for name, value in zip(h["names"], t, strict=True):
                    self.create(name, value, overwrite=bool(h.get("overwrite")))
            return {}, []

        def read(h: dict[str, Any], t: list[torch.Tensor]) -> Any:
            with self._lock:
                return {"version": self._version}, self.read(h["names"])

        def read_if_newer(h: dict[str, Any], t: list[torch.Tensor]) -> Any:
            with self._lock:
                if self._version == h.get("version"):
                    return {"version": self._version, "changed": False}, []
                return {"version": self._version, "changed": True}, self.read(h["names"])

        def create_optimizer(h: dict[str, Any], t: list[torch.Tensor]) -> Any:
            # The transport authenticated the caller before this runs: unpickling is safe here.
            cls = cloudpickle.loads(base64.b64decode(h["optimizer"]))
            self.create_optimizer(h["key"], cls, h["groups"], overwrite=bool(h.get("overwrite")))
            return {}, []

        def apply_gradients(h: dict[str, Any], t: list[torch.Tensor]) -> Any:
            grads = decode_gradients(h, t)
            with self._lock:  # with "return_values": the values right after this step
                version = self.apply_gradients(h["key"], h["names"], grads, h.get("hyperparameters"))
                return {"version": version}, self.read(h["names"]) if h.get("return_values") else []

        def optimizer_state(h: dict[str, Any], t: list[torch.Tensor]) -> Any:
            return encode_optimizer_state(self.optimizer_state(h["key"]))

        def load_optimizer_state(h: dict[str, Any], t: list[torch.Tensor]) -> Any:
            self.load_optimizer_state(h["key"], decode_optimizer_state(h, t))
            return {}, []

        return {
            "create": create,
            "read": read,
            "read_if_newer": read_if_newer,
            "read_rows": lambda h, t: ({}, [self.read_rows(h["name"], t[0])]),
            "assign": lambda h, t: ({"version": self.assign(h["names"], t)}, []),
            "assign_add": lambda h, t: ({"version": self.assign_add(h["names"], t)}, []),
            "version": lambda h, t: ({"version": self._version}, []),
            "names": lambda h, t: ({"names": self.names()}, []),
            "create_optimizer": create_optimizer,
            "apply_gradients": apply_gradients,
            "optimizer_state": optimizer_state,
            "load_optimizer_state": load_optimizer_state,
        }
