"""torchmetrics metrics in `Model.compile`: their own update/compute, their states summed globally.

A `torchmetrics.Metric` keeps states that its ``dist_reduce_fx`` says how to combine across
processes. `TorchMetric` runs the metric's ``update`` on each batch, in torch's order
``(preds, target)``, on a private copy per replica, and adds what the batch added to each
state to a phalanx SUM state (`Metric.add_state`): those are summed over every replica and
worker by the strategy, parameter servers included. ``result()`` hands the global sums to
the metric through its own synchronisation hook (``sync`` with a ``dist_sync_fn`` that
returns them, so the metric's reductions apply) and calls its ``compute``: the value is the
metric of the whole data. Only states reduced by ``"sum"`` can be combined this way; a
metric with another state (``"cat"``, ``"min"``, ``"max"``, ``"mean"``, a custom function) is
refused with the reason.

torchmetrics is optional (``pip install phalanx[torchmetrics]``); nothing here imports it
unless a torchmetrics object is passed.
"""

from __future__ import annotations

import copy
import sys
import threading
from typing import Any

import torch

from phalanx import context
from phalanx.losses._utils import to_snake_case
from phalanx.metrics.metric import Metric

__all__ = ["TorchMetric", "is_torchmetrics_metric"]


def is_torchmetrics_metric(obj: Any) -> bool:
    """Whether ``obj`` is a ``torchmetrics.Metric`` (without importing torchmetrics)."""
    module = sys.modules.get("torchmetrics")
    return module is not None and isinstance(obj, module.Metric)


# Module-level: a metric stays picklable (parameter-server workers receive the model pickled).
_copies_lock = threading.Lock()


def _sum_reduction() -> Any:
    from torchmetrics.utilities.data import dim_zero_sum

    return dim_zero_sum


class TorchMetric(Metric):
    """A ``torchmetrics.Metric`` in compile's metrics: global values under every strategy.

    Args:
        metric: The torchmetrics metric (not updated itself: it serves as the template of
            the per-replica copies, so it stays at its initial state).
        name: Name in logs (default: the metric's class name in snake case).

    Raises:
        TypeError: ``metric`` is not a torchmetrics metric.
        ValueError: A state of the metric is not reduced by ``"sum"``.
    """

    _template: Any

    def __init__(self, metric: Any, name: str | None = None) -> None:
        if not is_torchmetrics_metric(metric):
            raise TypeError(f"TorchMetric wraps a torchmetrics.Metric. Received: {type(metric).__name__}.")
        super().__init__(dtype=torch.float64, name=name or to_snake_case(type(metric).__name__))
        template = copy.deepcopy(metric)
        template.reset()
        self._check_states(template)
        object.__setattr__(self, "_template", template)  # not a submodule: its states are no buffers
        self._defaults: dict[str, torch.Tensor] = {}
        for state, default in template.metric_state.items():  # reset: each state holds its default
            self._defaults[state] = default.detach().clone()
            self.add_state(_buffer_name(state), tuple(default.shape), dtype=_total_dtype(default))
        self._copies: dict[Any, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_copies"] = {}  # the replicas' working copies are made again where it runs
        return state

    def _check_states(self, template: Any) -> None:
        total = _sum_reduction()
        defaults = template.metric_state  # reset: each state holds its default
        # torchmetrics keeps each state's reduction in this dict only (``add_state``'s dist_reduce_fx)
        for state, reduce_fx in template._reductions.items():
            default = defaults[state]
            if reduce_fx is total and isinstance(default, torch.Tensor):
                continue
            how = getattr(reduce_fx, "__name__", repr(reduce_fx))
            raise ValueError(
                f"{type(template).__name__} keeps state {state!r} reduced by {how} "
                f"({'a list' if isinstance(default, list) else 'a tensor'}); compile's metrics add "
                "their states across replicas and workers, which only states reduced by 'sum' allow. "
                "HINT: use a binned variant (e.g. thresholds=... for AUROC/AveragePrecision), or "
                "compute this metric on model.predict(...)'s outputs after fit."
            )

    def _replica_copy(self, device: torch.device) -> Any:
        """This replica's private copy of the metric (replicas of Mirrored run at once)."""
        ctx = context.current_replica_context()
        key = (ctx.local_replica_index if ctx is not None else None, threading.get_ident(), device)
        found = self._copies.get(key)
        if found is None:
            with _copies_lock:
                found = self._copies.setdefault(key, copy.deepcopy(self._template).to(device))
        return found

    @torch.no_grad()
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Adds one batch: the metric's ``update(y_pred, y_true)``, its state changes to the totals.

        Raises:
            ValueError: ``sample_weight`` is given (torchmetrics metrics take no sample weights).
        """
        if sample_weight is not None:
            raise ValueError(
                f"The torchmetrics metric {self.name!r} takes no sample_weight, and fit received one. "
                "HINT: use a phalanx.metrics metric (they weight examples), or fit without sample_weight."
            )
        pred = torch.as_tensor(y_pred)
        working = self._replica_copy(pred.device)
        working.reset()
        working.update(pred, torch.as_tensor(y_true, device=pred.device))
        for state, default in self._defaults.items():
            added = getattr(working, state) - default.to(pred.device)
            self._add(getattr(self, _buffer_name(state)), added)

    def result(self) -> torch.Tensor:
        """The metric's ``compute()`` on the states summed over every replica and worker."""
        totals = dict(zip(self._defaults, self._read(*map(_buffer_name, self._defaults)), strict=True))
        metric: Any = copy.deepcopy(self._template)
        metric.reset()
        by_id = {id(getattr(metric, state)): total for state, total in totals.items()}

        def gathered(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
            # What a gather over "processes" returns: the default, then every replica's additions.
            return [tensor, by_id[id(tensor)].to(device=tensor.device, dtype=tensor.dtype)]

        with metric.sync_context(dist_sync_fn=gathered, distributed_available=lambda: True):
            value = metric.compute.__wrapped__()  # the metric's compute, without syncing again
        value = torch.as_tensor(value, dtype=torch.float64).detach()
        return value.reshape(()) if value.numel() == 1 else value  # a scalar, as torchmetrics gives it

    def get_config(self) -> dict[str, Any]:
        """Name, dtype and the torchmetrics class (saved with a model; not rebuildable)."""
        return {**super().get_config(), "metric": type(self._template).__qualname__}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Metric:
        """Refuses: a torchmetrics object is not rebuilt from a Keras config.

        Raises:
            NotImplementedError: Always, with what to do instead.
        """
        raise NotImplementedError(
            f"A TorchMetric ({config.get('metric')}) cannot be rebuilt from a saved model's compile "
            "configuration. HINT: load_model(path, compile=False), then compile again with the "
            "torchmetrics object."
        )

    def extra_repr(self) -> str:
        return f"name={self.name!r}, metric={type(self._template).__name__}"


def _buffer_name(state: str) -> str:
    return f"total_{state}"


def _total_dtype(default: torch.Tensor) -> torch.dtype:
    """Integer counts add up exactly in float64 (to 2**53); floating states keep their dtype."""
    return default.dtype if default.is_floating_point() else torch.float64
