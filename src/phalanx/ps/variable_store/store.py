"""What a ps task holds: its variables, and the optimizers that update them.

Workers read variables and push gradients; each push is applied by a real ``torch.optim``
optimizer over this task's variables (its state lives here), atomically: pushes from
different workers never interleave. `VariableStore.handlers` is the RPC table a
`phalanx.ps.transport.RpcServer` serves; `phalanx.ps.messages` builds and reads its
messages.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from phalanx.ps import wire
from phalanx.ps.messages import (
    MESSAGE_HINT,
    decode_gradients,
    decode_optimizer_class,
    decode_optimizer_state,
    encode_optimizer_state,
)
from phalanx.ps.variable_store.optimizer import StoreOptimizer, check_groups
from phalanx.ps.variable_store.writes import Writes

__all__ = ["Handler", "VariableStore"]

Handler = Callable[
    [dict[str, Any], list[torch.Tensor]], tuple[dict[str, Any], list[torch.Tensor]] | wire.Packed
]
_CREATE_HINT = "HINT: create the model and the optimizer in strategy.scope() on the coordinator."


class VariableStore:
    """The variables of one ps task and the optimizers that update them. Thread-safe.

    Every method runs under one lock, so a push (hyperparameters, gradients, step) is atomic
    with respect to every read and every other push.

    Args:
        task_name: This task, for messages (e.g. ``"ps:0"``).
    """

    def __init__(self, task_name: str = "ps:0") -> None:
        self.task_name = task_name
        self._vars: dict[str, torch.Tensor] = {}
        self._optimizers: dict[str, StoreOptimizer] = {}
        self._version = 0
        # tells this store from one a restarted task made: versions count from 0 again there
        self.identity = secrets.token_hex(8)
        self._writes = Writes()  # what was written at which version (`changes_since`)
        self._lock = threading.RLock()

    def _get(self, name: str) -> torch.Tensor:
        try:
            return self._vars[name]
        except KeyError:
            raise KeyError(
                f"A variable must be created before it is used. Received: {name!r}, which {self.task_name} "
                f"has no variable {name!r}. {_CREATE_HINT}"
            ) from None

    def _check_like(self, name: str, current: torch.Tensor, value: torch.Tensor, what: str = "value") -> None:
        if value.shape != current.shape or value.dtype != current.dtype:
            raise ValueError(
                f"A {what} must have its variable's dtype and shape: variable {name!r} on {self.task_name} "
                f"is {current.dtype} {tuple(current.shape)}; received {value.dtype} {tuple(value.shape)}. "
                f"HINT: cast or reshape the {what}; a variable keeps its dtype and shape (use a new name)."
            )

    def _pairs(self, names: Sequence[str], values: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """The variables of ``names`` after checking ``values`` against them (one each)."""
        if len(names) != len(values) or len(set(names)) != len(names):
            raise ValueError(
                f"Each variable named takes exactly one {what}. Received: names {list(names)} and "
                f"{len(values)} {what}s. HINT: name each variable once, one {what} per name."
            )
        variables = [self._get(n) for n in names]
        for name, current, value in zip(names, variables, values, strict=True):
            self._check_like(name, current, value, what)
        return variables

    def _bump(self) -> int:
        self._version += 1
        return self._version

    # ------------------------------------------------------------------ variables
    def create(self, name: str, value: torch.Tensor, *, overwrite: bool = False) -> None:
        """Stores a detached CPU copy of ``value`` as ``name``.

        The same name, dtype and shape again is a no-op (a restarted coordinator creates its
        variables again) unless ``overwrite``, which replaces the value.

        Raises:
            ValueError: ``name`` exists with another dtype or shape.
        """
        with self._lock:
            current = self._vars.get(name)
            if current is None:
                self._vars[name] = value.detach().to("cpu", copy=True).contiguous()
                self._writes.whole([name], self._bump())
                return
            self._check_like(name, current, value)
            if overwrite:
                current.copy_(value.detach())  # in place: optimizers hold this tensor
                self._writes.whole([name], self._bump())

    def read(self, names: Sequence[str]) -> list[torch.Tensor]:
        """Copies of the values of ``names``, in order.

        Raises:
            KeyError: A name this task has no variable of.
        """
        with self._lock:
            return [self._get(n).clone() for n in names]

    def read_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of ``name`` along dim 0 (an embedding lookup).

        Raises:
            KeyError: No variable ``name``.
            ValueError: ``rows`` is not a 1-D integer tensor, or the variable is a scalar.
            IndexError: A row outside ``[0, number of rows)``.
        """
        with self._lock:
            table = self._get(name)
            if rows.dim() != 1 or rows.is_floating_point() or rows.is_complex() or table.dim() == 0:
                raise ValueError(
                    f"Rows are read with a 1-D integer tensor from a variable of at least one dimension. "
                    f"Received: rows {rows.dtype} {tuple(rows.shape)} for {name!r} {tuple(table.shape)} on "
                    f"{self.task_name}. HINT: pass torch.tensor([row, ...], dtype=torch.int64)."
                )
            bad = rows[(rows < 0) | (rows >= table.shape[0])]
            if bad.numel():
                raise IndexError(
                    f"Rows must lie in [0, {table.shape[0]}): variable {name!r} on {self.task_name} has "
                    f"{table.shape[0]} rows; asked for row {int(bad[0])}. "
                    "HINT: check the ids fed to the lookup (and the table's size)."
                )
            return table.index_select(0, rows.long())

    def assign(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> int:
        """Writes ``values`` (all or none); returns the new version.

        Raises:
            KeyError: An unknown name.
            ValueError: Not one value per distinct name, or a dtype or shape that differs.
        """
        with self._lock:
            for variable, value in zip(self._pairs(names, values, "value"), values, strict=True):
                variable.copy_(value)
            version = self._bump()
            self._writes.whole(names, version)
            return version

    def assign_add(self, names: Sequence[str], deltas: Sequence[torch.Tensor]) -> int:
        """Adds ``deltas`` (all or none); returns the new version. Raises as `assign`."""
        with self._lock:
            for variable, delta in zip(self._pairs(names, deltas, "value"), deltas, strict=True):
                variable.add_(delta)
            version = self._bump()
            self._writes.whole(names, version)
            return version

    def changes_since(
        self, names: Sequence[str], since: Sequence[int]
    ) -> tuple[list[str], list[torch.Tensor]]:
        """What changed in ``names`` after versions ``since`` (one each; -1: never read), from
        one snapshot: per variable ``"same"`` (nothing), ``"rows"`` (two tensors: the row
        numbers written since, and those rows) or ``"whole"`` (its value). Rows go only for a
        table that only row gradients wrote since, and only while they and their row numbers
        are fewer bytes than the table.

        Returns:
            The kinds, and the tensors in order (views of the variables: pack them under the lock).

        Raises:
            KeyError: An unknown name.
            ValueError: Not one version per name.
        """
        integers = isinstance(since, Sequence) and all(type(v) is int for v in since)
        if not integers or len(since) != len(names):
            raise ValueError(
                f"read_since takes one integer version per variable named. Received: {len(names)} names "
                f"and since {since!r:.80}. {MESSAGE_HINT}"
            )
        with self._lock:
            for name in names:
                self._get(name)
            return self._writes.changes(self._vars, names, since)

    def version(self) -> int:
        """A counter that grows by one with every write (create, assign, push, state load)."""
        return self._version

    def names(self) -> list[str]:
        """The variables' names, in the order they were created."""
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
        """Makes optimizer ``key``: ``optimizer_class`` over this task's variables.

        Args:
            key: The optimizer's name (the same on every ps task).
            optimizer_class: A ``torch.optim.Optimizer`` subclass.
            groups: One ``{"names": [...], **hyperparameters}`` per param group of the
                coordinator's optimizer; a group without variables here stays a placeholder
                so group indices match the coordinator's.
            overwrite: Replace an existing ``key`` (its state is dropped).

        The same key again, with the same class and variables, only updates hyperparameters.

        Raises:
            KeyError: A variable that does not exist.
            ValueError: A malformed group, or ``key`` exists with another class or variables.
        """
        where = f"optimizer {key!r} on {self.task_name}"
        with self._lock:
            check_groups(groups, where)
            for group in groups:
                for name in group["names"]:
                    self._get(name)
            existing = self._optimizers.get(key)
            if existing is None or overwrite:
                self._optimizers[key] = StoreOptimizer(optimizer_class, groups, self._vars)
            elif existing.same_as(optimizer_class, groups):
                existing.set_hyperparameters(
                    [{k: v for k, v in g.items() if k != "names"} for g in groups], where
                )
            else:
                raise ValueError(
                    f"An optimizer key keeps its class and variables. Received: {optimizer_class.__name__} "
                    f"over {[list(g['names']) for g in groups]}, but {where} is a {existing.cls.__name__} "
                    f"over {existing.names} (it has other variables). HINT: use another key, or overwrite."
                )

    def _optimizer(self, key: str) -> StoreOptimizer:
        try:
            return self._optimizers[key]
        except KeyError:
            raise KeyError(
                f"An optimizer must be created before it is used. Received: {key!r}, but {self.task_name} "
                f"has no optimizer {key!r}. {_CREATE_HINT}"
            ) from None

    def apply_gradients(
        self,
        key: str,
        names: Sequence[str],
        grads: Sequence[torch.Tensor],
        hyperparameters: Sequence[Mapping[str, Any]] | None = None,
    ) -> int:
        """One atomic step of optimizer ``key``; returns the new version.

        Sets each group's ``hyperparameters`` (if given), the gradients of exactly ``names``
        (dense or sparse COO), steps, and clears the gradients. The optimizer's other
        variables do not change, not even through momentum or weight decay.

        Raises:
            KeyError: An unknown optimizer.
            ValueError: A variable the optimizer does not update, not one gradient per distinct
                name, a gradient's dtype or shape, or hyperparameters (see ``StoreOptimizer``).
        """
        where = f"optimizer {key!r} on {self.task_name}"
        with self._lock:
            optimizer = self._optimizer(key)
            strangers = [n for n in names if n not in optimizer.members]
            if strangers:
                raise ValueError(
                    f"Gradients go to the variables an optimizer updates. Received: {strangers}; variable "
                    f"{strangers[0]!r} is not updated by {where}. "
                    "HINT: push with the optimizer of those variables."
                )
            variables = self._pairs(names, grads, "gradient")
            if hyperparameters is not None:
                optimizer.set_hyperparameters(hyperparameters, where)
            if not names:
                return self._version
            only_rows = [optimizer.changes_only_rows(v, g) for v, g in zip(variables, grads, strict=True)]
            optimizer.step(variables, grads)
            version = self._bump()
            for name, grad, rows in zip(names, grads, only_rows, strict=True):
                if rows:  # coalesce() is free for what workers send (`messages.decode_gradients`)
                    self._writes.rows(name, self._vars[name], grad.coalesce().indices()[0], version)
                else:
                    self._writes.whole([name], version)
            return version

    def optimizer_state(self, key: str) -> dict[str, Any]:
        """``{"state": {variable: {key: value}}, "groups": [hyperparameters]}`` (copies).

        Raises:
            KeyError: An unknown optimizer.
        """
        with self._lock:
            optimizer = self._optimizer(key)
            state: dict[str, dict[str, Any]] = {}
            if optimizer.torch is not None:
                for name in (n for names in optimizer.names for n in names):
                    entries = optimizer.torch.state.get(self._vars[name])
                    if entries:
                        state[name] = {
                            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()
                        }
            return {"state": state, "groups": [dict(h) for h in optimizer.hyper]}

    def load_optimizer_state(self, key: str, state: Mapping[str, Any]) -> None:
        """Restores what `optimizer_state` gave: variables absent from it lose their state.

        Raises:
            KeyError: An unknown optimizer.
            ValueError: State of a variable the optimizer does not update, or ``groups`` that
                do not fit (as for hyperparameters).
        """
        where = f"optimizer {key!r} on {self.task_name}"
        with self._lock:
            optimizer = self._optimizer(key)
            strangers = sorted(set(state.get("state", {})) - optimizer.members)
            if strangers:
                raise ValueError(
                    f"Optimizer state belongs to the variables the optimizer updates. Received: state of "
                    f"{strangers}; variable {strangers[0]!r} is not updated by {where}. "
                    f"HINT: load the state saved from this optimizer."
                )
            if state.get("groups"):
                optimizer.set_hyperparameters(state["groups"], where)
            if optimizer.torch is not None:
                optimizer.torch.state.clear()
                for name, entries in state.get("state", {}).items():
                    optimizer.torch.state[self._vars[name]] = {
                        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()
                    }
            self._bump()

    # ------------------------------------------------------------------ RPC table
    def handlers(self) -> dict[str, Handler]:
        """The RPC methods, each ``(header, tensors) -> (header, tensors)``.

        - ``create``: ``{"names", "overwrite"}``, the values -> ``{}``.
        - ``read``: ``{"names"}`` -> ``{"version"}``, the values.
        - ``read_if_newer``: ``{"names", "version", "rows": [tables]}``, one tensor of rows per
          table -> ``{"version", "changed"}``, the values only if the version is not the one
          given, then those rows of each table (`read_rows`, from the same snapshot).
        - ``read_rows``: ``{"name"}``, ``[rows]`` -> ``{}``, ``[those rows]``.
        - ``read_since``: ``{"names", "since": [version per name], "identity"}`` ->
          ``{"version", "identity", "kinds"}``, `changes_since`'s tensors (from one snapshot);
          another store's ``identity`` (a restarted task's) reads every variable whole.
        - ``assign`` / ``assign_add``: ``{"names"}``, the values -> ``{"version"}``.
        - ``create_optimizer``: ``{"key", "optimizer": encode_optimizer_class(cls), "groups",
          "overwrite"}`` -> ``{}``. Hyperparameters arrive as JSON: lists become tuples where the
          class's default is a tuple (Adam's betas).
        - ``apply_gradients``: `encode_gradients`'s header plus ``{"key", "hyperparameters":
          [per group] or null, "return_values": bool}``, its tensors -> ``{"version"}`` and, with
          ``return_values``, the variables' values right after this step.
        - ``optimizer_state``: ``{"key"}`` -> `encode_optimizer_state`'s header and tensors;
          ``load_optimizer_state``: those plus ``"key"`` -> ``{"version"}``.
        - ``version`` -> ``{"version"}``; ``names`` -> ``{"names"}``.
        """
        return {
            "create": self._rpc_create,
            "read": self._rpc_read,
            "read_if_newer": self._rpc_read_if_newer,
            "read_since": self._rpc_read_since,
            "read_rows": lambda h, t: ({}, [self.read_rows(h["name"], t[0])]),
            "assign": lambda h, t: ({"version": self.assign(h["names"], t)}, []),
            "assign_add": lambda h, t: ({"version": self.assign_add(h["names"], t)}, []),
            "version": lambda h, t: ({"version": self._version}, []),
            "names": lambda h, t: ({"names": self.names()}, []),
            "create_optimizer": self._rpc_create_optimizer,
            "apply_gradients": self._rpc_apply_gradients,
            "optimizer_state": lambda h, t: encode_optimizer_state(self.optimizer_state(h["key"])),
            "load_optimizer_state": self._rpc_load_optimizer_state,
        }

    def _rpc_create(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[dict[str, Any], list]:
        names = header["names"]
        if len(names) != len(tensors):
            raise ValueError(
                f"create takes one tensor per name. Received: {len(names)} names and {len(tensors)} tensors. "
                f"{MESSAGE_HINT}"
            )
        with self._lock:
            for name, value in zip(names, tensors, strict=True):
                self.create(name, value, overwrite=bool(header.get("overwrite")))
        return {}, []

    def _packed_read(
        self, header: dict[str, Any], names: list[str], after: Sequence[torch.Tensor] = ()
    ) -> wire.Packed:
        """``header`` and the values of ``names`` (then ``after``), packed under the lock: each
        value is copied once, into the reply, from one snapshot."""
        with self._lock:
            return wire.pack_reply(header, [self._get(n) for n in names] + list(after))

    def _rpc_read(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> wire.Packed:
        with self._lock:  # the version of these very values
            return self._packed_read({"version": self._version}, header["names"])

    def _rpc_read_since(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> wire.Packed:
        names, since = header["names"], header.get("since", "missing")
        if isinstance(since, list) and header.get("identity") != self.identity:
            since = [-1] * len(since)
        with self._lock:  # the kinds and values of one snapshot, copied once into the reply
            kinds, values = self.changes_since(names, since)
            reply = {"version": self._version, "identity": self.identity, "kinds": kinds}
            return wire.pack_reply(reply, values)

    def _rpc_read_if_newer(
        self, header: dict[str, Any], tensors: list[torch.Tensor]
    ) -> tuple[dict[str, Any], list] | wire.Packed:
        tables = header.get("rows") or []
        if len(tables) != len(tensors):
            raise ValueError(
                f"read_if_newer takes one tensor of rows per table named under 'rows'. Received: "
                f"{len(tables)} tables and {len(tensors)} tensors. {MESSAGE_HINT}"
            )
        with self._lock:  # the rows and the values of one snapshot
            looked_up = [self.read_rows(name, rows) for name, rows in zip(tables, tensors, strict=True)]
            if self._version == header.get("version"):
                return {"version": self._version, "changed": False}, looked_up
            return self._packed_read({"version": self._version, "changed": True}, header["names"], looked_up)

    def _rpc_create_optimizer(
        self, header: dict[str, Any], tensors: list[torch.Tensor]
    ) -> tuple[dict[str, Any], list]:
        # Unpickling runs code; the transport authenticated the caller (the cluster's token)
        # before any handler runs, so only the cluster's own tasks reach this.
        optimizer_class = decode_optimizer_class(header["optimizer"])
        self.create_optimizer(
            header["key"], optimizer_class, header["groups"], overwrite=bool(header.get("overwrite"))
        )
        return {}, []

    def _rpc_apply_gradients(
        self, header: dict[str, Any], tensors: list[torch.Tensor]
    ) -> tuple[dict[str, Any], list] | wire.Packed:
        grads = decode_gradients(header, tensors)
        with self._lock:  # the values read belong to this very step
            version = self.apply_gradients(
                header["key"], header["names"], grads, header.get("hyperparameters")
            )
            if header.get("return_values"):
                return self._packed_read({"version": version}, header["names"])
            return {"version": version}, []

    def _rpc_load_optimizer_state(
        self, header: dict[str, Any], tensors: list[torch.Tensor]
    ) -> tuple[dict[str, Any], list]:
        with self._lock:
            self.load_optimizer_state(header["key"], decode_optimizer_state(header, tensors))
            return {"version": self._version}, []
