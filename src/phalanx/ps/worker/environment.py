"""The worker task of a parameter-server cluster: runs the functions the coordinator schedules.

One function runs at a time. Before it runs, every variable it reaches is read from its ps
task into this worker's local copy; ``optimizer.step()`` inside it sends the gradients to
the ps tasks, which apply them (the local copies are then read back); changes the function
made to module buffers (BatchNorm statistics) are added to the ps copies afterwards.
Per-worker datasets and their iterators are made here on first use and kept between
functions.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cloudpickle
import torch

from phalanx.ps import pickling
from phalanx.ps.variables import PSClient, VariableHandle
from phalanx.ps.worker import embedding
from phalanx.strategies.strategy import Strategy

__all__ = ["OutOfRangeError", "WorkerEnvironment", "WorkerStrategy"]

_current = threading.local()


class OutOfRangeError(Exception):
    """A per-worker iterator had no more data (tf.errors.OutOfRangeError)."""


def _env() -> WorkerEnvironment:
    env = getattr(_current, "env", None)
    if env is None:
        raise RuntimeError(
            "A parameter-server variable or per-worker iterator was unpickled outside a worker "
            "of a parameter-server cluster. HINT: it can only be used inside a function given to "
            "ClusterCoordinator.schedule."
        )
    return env


class _PushGradients:
    """The worker strategy's optimizer-step hook: sends gradients to the ps tasks."""

    def __init__(self, env: WorkerEnvironment) -> None:
        self._env = env

    def before_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        self._env.push_gradients(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        return None

    def reset_thread(self) -> None:
        return None


class WorkerStrategy(Strategy):
    """What ``strategy`` is inside a scheduled function on a worker: one local replica
    (``run`` calls the function, ``reduce`` is local), optimizer steps go to the ps tasks."""

    def __init__(self, env: WorkerEnvironment) -> None:
        super().__init__(["cpu:0"])
        self._env = env
        self._step_sync = _PushGradients(env)

    @property
    def worker_index(self) -> int:
        """This worker's index in the cluster's ``worker`` job."""
        return self._env.worker_index

    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        raise RuntimeError(
            f"A parameter ({type(module).__name__}.{name}) was created inside a scheduled function. "
            "With ParameterServerStrategy, variables live on the ps tasks and are created by the "
            "coordinator. HINT: create models and optimizers in strategy.scope() before scheduling."
        )

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        return None

    def _step_outside_run(self, optimizer: torch.optim.Optimizer) -> None:
        self._env.push_gradients(optimizer)

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(worker {self._env.worker_index})"


class WorkerEnvironment:
    """This worker's copies of ps variables, its per-worker resources and its strategy.

    Args:
        ps: The client of the cluster's ps tasks.
        worker_index, num_workers: This worker and the size of the ``worker`` job.
    """

    def __init__(self, ps: PSClient, worker_index: int, num_workers: int) -> None:
        self.ps, self.worker_index, self.num_workers = ps, worker_index, num_workers
        self.variables: dict[str, torch.Tensor] = {}
        self.handles: dict[str, VariableHandle] = {}
        self.names_by_id: dict[int, str] = {}
        self.resources: dict[str, Any] = {}
        self.optimizers: set[str] = set()
        self.used: dict[str, VariableHandle] = {}
        self.buffers_read: dict[str, torch.Tensor] = {}  # buffer values as read
        self.read_at: dict[str, int] = {}  # the ps version each local copy was read at
        self.ps_version: dict[int, int] = {}  # the latest version seen of each ps task
        self.lazy: dict[str, VariableHandle] = {}  # sharded embedding tables, read by rows
        self.lookups: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.strategy = WorkerStrategy(self)
        embedding.install()
        self._lock = threading.Lock()  # one function at a time

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Makes this the environment that unpickling and hooks on this thread refer to."""
        previous = getattr(_current, "env", None)
        _current.env = self
        try:
            yield
        finally:
            _current.env = previous

    # ------------------------------------------------------------------ variables
    def variable(self, handle: VariableHandle) -> torch.Tensor:
        """This worker's tensor for ``handle`` (made on first use; values come from `refresh`)."""
        tensor = self.variables.get(handle.name)
        if tensor is None:
            tensor = handle.empty()
            if handle.kind in ("parameter", "embedding"):
                tensor = torch.nn.Parameter(tensor, requires_grad=handle.requires_grad)
            self.variables[handle.name] = tensor
            self.handles[handle.name] = handle
            self.names_by_id[id(tensor)] = handle.name
        self.used[handle.name] = handle
        if handle.kind == "embedding":
            self.lazy[handle.name] = handle
        return tensor

    # ------------------------------------------------------------------ sharded embedding tables
    def _name_of(self, tensor: torch.Tensor) -> str | None:
        name = self.names_by_id.get(id(tensor))
        return name if name is not None and self.variables.get(name) is tensor else None

    def is_lazy(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a sharded embedding table this function reads by rows."""
        return self._name_of(tensor) in self.lazy

    def read_whole(self, tensor: torch.Tensor) -> None:
        """Reads a table whole (a module other than its embedding uses it)."""
        name = self._name_of(tensor)
        if name is not None and self.lazy.pop(name, None) is not None:
            self.read_at.pop(name, None)
            self.refresh([self.handles[name]])

    def lookup_rows(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The current values of ``rows`` of a lazy table, kept for its gradient."""
        name = self._name_of(tensor)
        assert name is not None
        values = self.ps.read_rows(self.handles[name], rows)
        self.lookups.setdefault(name, []).append((rows, values))
        return values

    def refresh(self, handles: Sequence[VariableHandle]) -> None:
        """Brings the local tensors of ``handles`` up to date with their ps tasks (a ps task
        that has not changed since this worker's copies were read sends nothing)."""
        handles = [h for h in handles if h.name not in self.lazy]
        if not handles:
            return
        known = dict(self.ps_version)
        for handle in handles:
            if self.read_at.get(handle.name) != known.get(handle.ps):
                known[handle.ps] = -1  # a copy older than the rest: read them all
        values, versions = self.ps.read_changed(handles, known)
        with torch.no_grad():
            for i, handle in enumerate(handles):
                tensor = self.variables[handle.name]
                if i in values:
                    tensor.copy_(values[i])
                    self.read_at[handle.name] = versions[handle.ps]
                if handle.kind == "buffer":
                    self.buffers_read[handle.name] = tensor.detach().clone()
        self.ps_version.update(versions)

    def _updated(
        self, handles: Sequence[VariableHandle], values: Sequence[torch.Tensor], versions: dict[int, int]
    ) -> None:
        """Takes the values a push returned; copies read before it stay current if the push
        was the only write to their ps task since."""
        for ps, version in versions.items():
            before = self.ps_version.get(ps)
            if before is not None and version == before + 1:
                for name, at in self.read_at.items():
                    if at == before and self.handles[name].ps == ps:
                        self.read_at[name] = version
            self.ps_version[ps] = version
        with torch.no_grad():
            for handle, value in zip(handles, values, strict=True):
                self.variables[handle.name].copy_(value)
                self.read_at[handle.name] = versions[handle.ps]

    def push_buffer_changes(self) -> None:
        """Adds to the ps copies what the function changed in module buffers."""
        handles, deltas = [], []
        for name, read in self.buffers_read.items():
            tensor = self.variables[name]
            # by value: kernels such as batch_norm update running statistics without a version bump
            if not torch.equal(tensor, read):
                handles.append(self.handles[name])
                delta = tensor.detach() - read if tensor.dtype != torch.bool else tensor.detach()
                deltas.append(delta)
        self.buffers_read.clear()
        if handles:
            self.ps.write("assign_add", handles, deltas)

    # ------------------------------------------------------------------ optimizer steps
    def push_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Sends the gradients of ``optimizer``'s variables to the ps tasks, which apply them
        with a copy of this optimizer; reads the new values back. Clears the gradients so the
        local ``step`` that follows changes nothing."""
        groups = [[self._handle_of(p) for p in group["params"]] for group in optimizer.param_groups]
        hyper = [_hyperparameters(group) for group in optimizer.param_groups]
        key = _optimizer_key(optimizer, groups)
        if key not in self.optimizers:
            self.ps.create_optimizer(key, type(optimizer), list(zip(groups, hyper, strict=True)))
            self.optimizers.add(key)
        handles, grads, by_rows, row_grads = [], [], [], []
        for group in optimizer.param_groups:
            for p in group["params"]:
                handle = self._handle_of(p)
                from_rows = embedding.sparse_gradient(handle.shape, self.lookups.pop(handle.name, []))
                if handle.name in self.lazy:
                    if from_rows is not None:
                        by_rows.append(handle)
                        row_grads.append(from_rows)
                elif p.grad is not None or from_rows is not None:
                    grad = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
                    if from_rows is not None:  # looked up by rows, then used whole (tied weights)
                        grad = grad + from_rows.to_dense()
                    handles.append(handle)
                    grads.append(grad)
                    p.grad = None
        if handles:
            values, versions = self.ps.apply_gradients(key, handles, grads, hyper)
            self._updated(handles, values, versions)
        if by_rows:  # a separate step of the same per-parameter optimizer; no table comes back
            _, versions = self.ps.apply_gradients(key, by_rows, row_grads, hyper, return_values=False)
            self._updated([], [], versions)

    def _handle_of(self, tensor: torch.Tensor) -> VariableHandle:
        name = self.names_by_id.get(id(tensor))
        if name is None or self.variables.get(name) is not tensor:
            raise ValueError(
                "An optimizer stepped inside a scheduled function holds a tensor that is not a "
                f"variable of the parameter-server cluster (shape {tuple(tensor.shape)}). HINT: "
                "create the model and the optimizer inside strategy.scope() on the coordinator."
            )
        return self.handles[name]

    # ------------------------------------------------------------------ resources
    def dataset(self, dataset_id: str, make: bytes) -> Any:
        """The per-worker dataset ``dataset_id``, made here on first use."""
        if dataset_id not in self.resources:
            fn = pickling.loads(make)
            self.resources[dataset_id] = _call_dataset_fn(fn, self)
        return self.resources[dataset_id]

    def iterator(self, iterator_id: str, dataset_id: str, make: bytes) -> _LocalIterator:
        """The per-worker iterator ``iterator_id`` (over dataset ``dataset_id``)."""
        if iterator_id not in self.resources:
            self.resources[iterator_id] = _LocalIterator(
                iter(self.dataset(dataset_id, make)), self.worker_index
            )
        iterator = self.resources[iterator_id]
        assert isinstance(iterator, _LocalIterator)
        return iterator

    # ------------------------------------------------------------------ running
    def run(self, payload: bytes) -> tuple[bool, bytes]:
        """Runs one scheduled function; (True, pickled result) or (False, pickled error)."""
        with self._lock, self.active():
            self.used, self.lazy, self.lookups = {}, {}, {}
            try:
                fn, args, kwargs = pickling.loads(payload)
                self.refresh(list(self.used.values()))
                with self.strategy.scope():
                    result = fn(*args, **kwargs)
                self.push_buffer_changes()
                return True, cloudpickle.dumps(_detached(result))
            except BaseException as exc:
                self.buffers_read.clear()
                return False, pickling.dumps_exception(_with_remote_traceback(exc, self.worker_index))

    def handlers(self) -> dict[str, Callable[[dict[str, Any], list[torch.Tensor]], Any]]:
        """The worker's RPC table: ``ping`` and ``run`` (payload and reply as one uint8 tensor)."""

        def ping(header: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
            return {"worker": self.worker_index}, []

        def run(header: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
            ok, data = self.run(tensors[0].numpy().tobytes())
            return {"ok": ok}, [torch.frombuffer(bytearray(data), dtype=torch.uint8)]

        return {"ping": ping, "run": run}


class _LocalIterator:
    """A worker's iterator of a per-worker dataset; exhaustion raises `OutOfRangeError`."""

    def __init__(self, iterator: Iterator[Any], worker_index: int) -> None:
        self._iterator, self._worker = iterator, worker_index

    def __iter__(self) -> _LocalIterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            raise OutOfRangeError(
                f"The per-worker dataset of worker {self._worker} is exhausted. HINT: repeat the "
                "dataset (dataset.repeat()) and schedule a fixed number of steps per epoch, as with TF."
            ) from None

    def get_next(self) -> Any:
        """The next element (TF's spelling)."""
        return next(self)


def _call_dataset_fn(fn: Callable[..., Any], env: WorkerEnvironment) -> Any:
    from phalanx.input.input_options import InputContext

    try:
        wants_context = len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        wants_context = False
    if not wants_context:
        return fn()
    return fn(InputContext(num_input_pipelines=env.num_workers, input_pipeline_id=env.worker_index))


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            value = value.item()
        out[key] = list(value) if isinstance(value, tuple) else value
    json.dumps(out)  # fails early, naming nothing sent that the ps could not read
    return out


def _optimizer_key(optimizer: torch.optim.Optimizer, groups: list[list[VariableHandle]]) -> str:
    """The same on every worker for the same optimizer: its class and variables."""
    text = type(optimizer).__qualname__ + "|" + "|".join(",".join(h.name for h in g) for g in groups)
    return f"{type(optimizer).__name__}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone() if not value.is_sparse else value.detach().cpu()
    if isinstance(value, (list, tuple)):
        items = [_detached(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _with_remote_traceback(exc: BaseException, worker_index: int) -> BaseException:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    with contextlib.suppress(Exception):
        exc.add_note(f"(raised on worker {worker_index}:)\n{text}")  # type: ignore[attr-defined]
    return exc


# ---------------------------------------------------------------------- rebuilt on the worker
def _worker_variable(handle: VariableHandle) -> torch.Tensor:
    return _env().variable(handle)


def _worker_value(values: tuple[Any, ...]) -> Any:
    env = _env()
    if len(values) != env.num_workers:
        raise ValueError(
            f"PerWorkerValues needs one value per worker ({env.num_workers}). Received: {len(values)}."
        )
    return values[env.worker_index]


def _worker_strategy() -> WorkerStrategy:
    return _env().strategy


def _worker_dataset(dataset_id: str, make: bytes) -> Any:
    return _env().dataset(dataset_id, make)


def _worker_iterator(iterator_id: str, dataset_id: str, make: bytes) -> _LocalIterator:
    return _env().iterator(iterator_id, dataset_id, make)
