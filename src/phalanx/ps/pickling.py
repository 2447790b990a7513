"""How a scheduled function travels from the chief to a worker: the by-reference contract.

The function, its arguments and everything they reach (the model, the optimizer, the
strategy, per-worker iterators) are pickled with cloudpickle, except the objects below: they
travel as a reference that the worker resolves to its own copy. Both halves live here:

===========================  ===================================  ===============================
on the chief                 travels as                           on the worker
===========================  ===================================  ===============================
a variable (a tensor made    its `VariableHandle`                 the worker's local tensor,
in ``strategy.scope()``)                                          read from the ps tasks before
                                                                  the function runs
the ParameterServerStrategy  nothing                              the worker's `WorkerStrategy`
`PerWorkerValues`            every worker's value                 the value of this worker
`PerWorkerDataset`           its id and its pickled dataset_fn    this worker's dataset, made on
                                                                  first use
`PerWorkerIterator`          its id and its dataset's             this worker's iterator
an optimizer                 by value, once its state moved to    the same class; its step goes
                             the ps tasks (`adopt_optimizer`)     to the ps tasks
a ``torch.amp.GradScaler``   its key, class and the chief's       this worker's own scaler, made
(also inside phalanx's       state                                from the chief's state on first
`LossScaleOptimizer`)                                             use and kept across functions
                                                                  (loss scaling per worker, as TF)
the ClusterCoordinator       refused (TypeError)                  -
===========================  ===================================  ===============================

Nothing is unpickled before the transport authenticated the caller (see
`phalanx.ps.transport`).
"""

from __future__ import annotations

import io
import pickle
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import cloudpickle
import torch

from phalanx.input.per_worker import PerWorkerDataset, PerWorkerIterator, PerWorkerValues
from phalanx.ps.worker import context

if TYPE_CHECKING:
    from phalanx.input.per_worker import WorkerIterator
    from phalanx.protocols import DistributionStrategy
    from phalanx.ps.handles import VariableHandle

__all__ = [
    "ChiefObjects",
    "dataset_on_worker",
    "dumps",
    "dumps_exception",
    "dumps_for_worker",
    "iterator_on_worker",
    "loads",
    "replace_for_worker",
    "scaler_on_worker",
    "strategy_on_worker",
    "value_on_worker",
    "variable_on_worker",
]


# ---------------------------------------------------------------------- the chief's half
class ChiefObjects(Protocol):
    """What the chief's rules need to know (`phalanx.ps.coordinator.chief.Chief` has it)."""

    @property
    def strategy(self) -> object:
        """The ParameterServerStrategy (sent as the worker's strategy)."""

    @property
    def coordinator(self) -> object | None:
        """The ClusterCoordinator (never sent)."""

    def handle_of(self, tensor: torch.Tensor) -> VariableHandle | None:
        """The handle of ``tensor`` if it is one of the chief's variables."""

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Moves ``optimizer``'s state to the ps tasks (once per optimizer)."""


def _per_worker_reference(obj: Any) -> Any:
    if isinstance(obj, PerWorkerValues):
        return value_on_worker, (obj.values,)
    if isinstance(obj, PerWorkerIterator):
        dataset = obj.dataset
        return iterator_on_worker, (obj.iterator_id, dataset.dataset_id, dataset.pickled_fn)
    if isinstance(obj, PerWorkerDataset):
        return dataset_on_worker, (obj.dataset_id, obj.pickled_fn)
    if isinstance(obj, torch.amp.GradScaler):
        # a key of its own (an id could be reused by a later scaler after this one died)
        key = obj.__dict__.setdefault("_phalanx_scaler_key", uuid.uuid4().hex)
        return scaler_on_worker, (key, type(obj), obj.__getstate__())
    return NotImplemented


def _chief_reference(chief: ChiefObjects, obj: Any) -> Any:
    if isinstance(obj, torch.optim.Optimizer):
        chief.adopt_optimizer(obj)
        return NotImplemented  # by value: its state now lives on the ps tasks
    if isinstance(obj, torch.Tensor):
        handle = chief.handle_of(obj)
        return NotImplemented if handle is None else (variable_on_worker, (handle,))
    if obj is chief.strategy:
        return strategy_on_worker, ()
    coordinator = chief.coordinator
    if coordinator is not None and obj is coordinator:
        raise TypeError(
            "A scheduled function uses the ClusterCoordinator, which exists on the chief only. "
            "HINT: schedule functions from the training loop, not from inside another function."
        )
    return NotImplemented


class _Pickler(cloudpickle.CloudPickler):
    def __init__(self, file: io.BytesIO, replace: Callable[[Any], Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._replace = replace

    def reducer_override(self, obj: Any) -> Any:
        reduced = _per_worker_reference(obj)
        if reduced is NotImplemented:
            reduced = self._replace(obj)
        if reduced is not NotImplemented:
            return reduced
        return super().reducer_override(obj)


def _by_value(obj: Any) -> Any:
    return NotImplemented


def dumps(obj: Any, replace: Callable[[Any], Any] = _by_value) -> bytes:
    """Pickles ``obj``, per-worker values by reference; ``replace(x)`` returns a reduce tuple
    for other objects sent by reference, or ``NotImplemented`` for the rest."""
    buffer = io.BytesIO()
    _Pickler(buffer, replace).dump(obj)
    return buffer.getvalue()


def dumps_for_worker(obj: Any, chief: ChiefObjects) -> bytes:
    """Pickles a scheduled function (or anything it reaches) for a worker, with every
    reference of the table above (the chief calls this for each closure it sends).

    Raises:
        TypeError: ``obj`` reaches the ClusterCoordinator.
        ValueError: An optimizer it reaches holds a tensor not created in ``strategy.scope()``.
    """
    return dumps(obj, replace_for_worker(chief))


def replace_for_worker(chief: ChiefObjects) -> Callable[[Any], Any]:
    """The ``replace`` of `dumps` that sends ``chief``'s objects by reference (the table above)."""
    return lambda x: _chief_reference(chief, x)


def loads(data: bytes) -> Any:
    """Unpickles what `dumps` made (only from an authenticated peer); on a worker, inside
    `phalanx.ps.worker.context.running`, references resolve to that worker's objects."""
    return pickle.loads(data)  # noqa: S301 - the transport authenticated the sender


def dumps_exception(exc: BaseException) -> bytes:
    """Pickles an exception so the chief raises the same type; one that cannot be pickled
    becomes a RuntimeError with its type and message."""
    try:
        data = cloudpickle.dumps(exc)
        pickle.loads(data)  # noqa: S301 - our own bytes
        return data
    except Exception:
        return cloudpickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------------- the worker's half
def _worker() -> context.Environment:
    env = context.current()
    if env is None:
        raise RuntimeError(
            "A parameter-server variable or per-worker iterator was unpickled outside a worker "
            "of a parameter-server cluster. HINT: it can only be used inside a function given to "
            "ClusterCoordinator.schedule."
        )
    return env


def variable_on_worker(handle: VariableHandle) -> torch.Tensor:
    """The worker's tensor of the variable ``handle`` (its value is read before the function runs)."""
    return _worker().variable(handle)


def value_on_worker(values: tuple[Any, ...]) -> Any:
    """This worker's entry of a `PerWorkerValues`.

    Raises:
        ValueError: ``values`` does not have one entry per worker.
    """
    env = _worker()
    if len(values) != env.num_workers:
        raise ValueError(
            f"PerWorkerValues needs one value per worker ({env.num_workers}). Received: {len(values)}."
        )
    return values[env.worker_index]


def scaler_on_worker(
    key: str, cls: type[torch.amp.GradScaler], state: dict[str, Any]
) -> torch.amp.GradScaler:
    """This worker's loss scaler ``key``: made from the chief's ``state`` at its first
    function, then the same object for every later one, so its scale follows this worker's
    overflows (each worker scales on its own, as in TF)."""
    resources = _worker().resources
    name = f"scaler:{key}"
    if name not in resources:
        scaler = cls.__new__(cls)
        scaler.__setstate__(dict(state))
        resources[name] = scaler
    scaler = resources[name]
    assert isinstance(scaler, torch.amp.GradScaler)
    return scaler


def strategy_on_worker() -> DistributionStrategy:
    """The worker's strategy (what ``strategy`` is inside a scheduled function)."""
    return _worker().strategy


def dataset_on_worker(dataset_id: str, pickled_fn: bytes) -> Any:
    """This worker's dataset ``dataset_id``, made on first use."""
    return _worker().dataset(dataset_id, pickled_fn)


def iterator_on_worker(iterator_id: str, dataset_id: str, pickled_fn: bytes) -> WorkerIterator:
    """This worker's iterator ``iterator_id`` over its dataset ``dataset_id``."""
    return _worker().iterator(iterator_id, dataset_id, pickled_fn)
