"""A ps task's optimizer: a real ``torch.optim`` optimizer over the task's variables, with the
hyperparameters and state the coordinator gave it (used by
`phalanx.ps.variable_store.store.VariableStore`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from phalanx import _hooks
from phalanx.ps.variable_store import sparse_adagrad

__all__ = ["StoreOptimizer", "check_groups"]


class StoreOptimizer:
    """A torch optimizer over some of this task's variables; groups without any stay placeholders.

    Group ``i`` of the coordinator's optimizer is torch's group ``real.index(i)`` here, so the
    hyperparameters of every group keep the coordinator's indices.
    """

    def __init__(
        self,
        optimizer_class: type,
        groups: Sequence[Mapping[str, Any]],
        variables: Mapping[str, torch.Tensor],
    ) -> None:
        self.cls = optimizer_class
        signature = _init_defaults(optimizer_class)
        self.tuple_keys = {k for k, v in signature.items() if isinstance(v, tuple)}
        self.names = [list(g["names"]) for g in groups]
        self.hyper = [self.converted({k: v for k, v in g.items() if k != "names"}) for g in groups]
        self.real = [i for i, names in enumerate(self.names) if names]
        self.members = {name for names in self.names for name in names}
        self.torch: torch.optim.Optimizer | None = None
        if self.real:
            param_groups = [
                {"params": [variables[n] for n in self.names[i]], **self.hyper[i]} for i in self.real
            ]
            self.torch = optimizer_class(param_groups)
        self._group_of: dict[int, dict[str, Any]] = {
            id(p): group for group in (self.torch.param_groups if self.torch else []) for p in group["params"]
        }

    def same_as(self, optimizer_class: type, groups: Sequence[Mapping[str, Any]]) -> bool:
        """Same class (by identity, or by name when cloudpickle rebuilt it) and same variables."""
        same_class = self.cls is optimizer_class or (
            (self.cls.__module__, self.cls.__qualname__)
            == (optimizer_class.__module__, optimizer_class.__qualname__)
        )
        return same_class and self.names == [list(g["names"]) for g in groups]

    def converted(self, hyper: Mapping[str, Any]) -> dict[str, Any]:
        """JSON lists back to tuples where the class's default is a tuple (Adam's betas)."""
        return {k: tuple(v) if k in self.tuple_keys and isinstance(v, list) else v for k, v in hyper.items()}

    def set_hyperparameters(self, hyperparameters: Sequence[Mapping[str, Any]], where: str) -> None:
        """Group ``i`` takes ``hyperparameters[i]``; all are checked before any is set.

        A key a group does not have yet is added, as torch param groups carry any key (an LR
        scheduler attached later adds ``initial_lr``).

        Raises:
            ValueError: Not one mapping per group, or ``params``/``names`` among the keys.
        """
        if len(hyperparameters) != len(self.names):
            raise ValueError(
                f"Hyperparameters come one mapping per param group. Received: {len(hyperparameters)} for "
                f"the {len(self.names)} param groups of {where}. HINT: send every group, in order."
            )
        updates = [self.converted(h) for h in hyperparameters]
        for i, update in enumerate(updates):
            reserved = sorted({"params", "names"} & set(update))
            if reserved:
                raise ValueError(
                    f"Hyperparameters cannot set {reserved}: a param group's variables are fixed when "
                    f"the optimizer is created. Received them for group {i} of {where}."
                )
        for i, update in enumerate(updates):
            self.hyper[i].update(update)
            if self.torch is not None and i in self.real:
                self.torch.param_groups[self.real.index(i)].update(update)

    def takes_sparse(self) -> bool:
        """Whether torch applies sparse gradients as they are (SparseAdam; SGD and Adagrad
        without weight decay). Others get them densified: a sparse gradient is a dense one that
        is zero off its rows, so the update is the one that dense gradient gives."""
        assert self.torch is not None
        if isinstance(self.torch, torch.optim.SparseAdam):
            return True
        if isinstance(self.torch, (torch.optim.SGD, torch.optim.Adagrad)):
            return all(not g.get("weight_decay") for g in self.torch.param_groups)
        return False

    def changes_only_rows(self, variable: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether a step with ``grad`` changes only the rows ``grad`` holds: a row gradient
        (sparse COO along the first axis) taken as it is by an optimizer whose sparse update
        touches nothing else (SparseAdam; Adagrad without weight decay; SGD without weight
        decay or momentum, whose sparse buffer would carry earlier rows), of torch's own class
        (a subclass may step otherwise), with no step hooks but phalanx's own (a hook may write
        anything; phalanx's only tell the strategy of the calling thread, none on a ps task's)."""
        if self.torch is None or not grad.is_sparse or grad.sparse_dim() != 1 or not self.takes_sparse():
            return False
        if _foreign_step_hooks(self.torch):
            return False
        kind = type(self.torch)
        if kind is torch.optim.SparseAdam or kind is torch.optim.Adagrad:
            return True
        group = self._group_of.get(id(variable))
        return kind is torch.optim.SGD and group is not None and not group.get("momentum")

    def step(self, variables: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """One ``optimizer.step()`` with exactly these gradients; other variables have none, and
        torch optimizers leave a parameter without gradient (and its state) untouched."""
        assert self.torch is not None
        dense = not self.takes_sparse()
        rows: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        try:
            for variable, grad in zip(variables, grads, strict=True):
                grad = grad.detach().to("cpu")
                group = self._group_of.get(id(variable))
                if group is not None and sparse_adagrad.takes(self.torch, group, variable, grad):
                    rows.append((group, variable, grad))  # torch's update, without its sparse tensors
                else:
                    variable.grad = grad.to_dense() if dense and grad.is_sparse else grad
            if not rows:
                self.torch.step()
                return
            with sparse_adagrad.step_hooks(self.torch):  # one step: its hooks run once, around all
                for group, variable, grad in rows:
                    sparse_adagrad.apply_rows(group, self.torch.state[variable], variable, grad)
                if len(rows) < len(variables):
                    sparse_adagrad.step_without_hooks(self.torch)
        finally:
            for variable in variables:
                variable.grad = None


def _foreign_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step hook other than phalanx's may run around ``optimizer.step()``."""
    before, after = _hooks.optimizer_step_hooks(optimizer)
    return any(not getattr(hook, "__module__", "").startswith("phalanx.") for hook in (*before, *after))


def _init_defaults(optimizer_class: type) -> dict[str, Any]:
    try:
        parameters = inspect.signature(optimizer_class).parameters
    except (TypeError, ValueError):
        return {}
    return {name: p.default for name, p in parameters.items()}


def check_groups(groups: Sequence[Mapping[str, Any]], where: str) -> None:
    seen: set[str] = set()
    for i, group in enumerate(groups):
        if "params" in group or not isinstance(group.get("names"), (list, tuple)):
            raise ValueError(
                f"Each param group names its variables under 'names' and has no 'params'. Received: "
                f"group {i} of {where} with keys {sorted(group)}. HINT: {{'names': [...], 'lr': ...}}."
            )
        names = list(group["names"])
        twice = sorted({n for n in names if n in seen or names.count(n) > 1})
        if twice:
            raise ValueError(
                f"A variable belongs to at most one param group, once. Received: group {i} of {where} with "
                f"{names}, repeating {twice}. HINT: list each variable once."
            )
        seen.update(group["names"])


# ---------------------------------------------------------------------- the store
