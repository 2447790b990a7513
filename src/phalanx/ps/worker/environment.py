"""The worker task of a parameter-server cluster: runs the functions the coordinator schedules.

One function runs at a time. Unpickling it resolves its references to this worker's objects
(`phalanx.ps.pickling`); before it runs, every variable it reaches is read from its ps task
into this worker's local copy; ``optimizer.step()`` inside it sends the gradients to
the ps tasks, which apply them (the local copies are then read back); changes the function
made to module buffers (BatchNorm statistics, metric states) go back with its result, and the
coordinator adds them to the ps copies when it takes the result (`BufferChanges`): a function
the coordinator gave up on and ran again elsewhere never adds them, so every example a metric
counts is counted once, whenever a network partition falls.
Per-worker datasets and their iterators are made here on first use and kept between
functions (`phalanx.input.per_worker`).
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
import torch

from phalanx import timeline
from phalanx.input.per_worker import WorkerIterator, make_dataset
from phalanx.ps import pickling
from phalanx.ps.messages import hyperparameters, optimizer_key
from phalanx.ps.variables import BufferChanges, PSClient, VariableHandle
from phalanx.ps.worker import context, embedding
from phalanx.ps.worker.after_push import AfterPush
from phalanx.ps.worker.running import RunningClosure

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = ["WorkerEnvironment"]


class WorkerEnvironment:
    """This worker's copies of ps variables, its per-worker resources and its strategy.

    Args:
        ps: The client of the cluster's ps tasks.
        worker_index, num_workers: This worker and the size of the ``worker`` job.
        current: What it runs, for the heartbeat (the one whose tag ``ps``'s clients send).
        make_strategy: Makes the strategy scheduled functions see, from this environment
            (`phalanx.strategies.parameter_server_worker.WorkerStrategy`; given by `phalanx.Server`,
            which sits above both this package and the strategies).
    """

    def __init__(
        self,
        ps: PSClient,
        worker_index: int,
        num_workers: int,
        current: RunningClosure | None = None,
        *,
        make_strategy: Callable[[WorkerEnvironment], DistributionStrategy],
    ) -> None:
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
        self.strategy = make_strategy(self)
        self.after_push = AfterPush(self._refresh_names)
        embedding.install()
        self._lock = threading.Lock()  # one function at a time
        self.current = current or RunningClosure()  # what the coordinator's heartbeat asks about

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
        """The current values of ``rows`` of a lazy table, kept for its gradient; the variables
        pending a read (`AfterPush`) come in the same RPC to each ps task."""
        name = self._name_of(tensor)
        assert name is not None
        pending = [self.handles[n] for n in self.after_push.take()]
        values = self.refresh(pending, (self.handles[name], rows))
        assert values is not None
        self.lookups.setdefault(name, []).append((rows, values))
        return values

    def refresh(
        self, handles: Sequence[VariableHandle], lookup: tuple[VariableHandle, torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """Brings the local tensors of ``handles`` up to date with their ps tasks (a ps task
        that has not changed since this worker's copies were read sends nothing); with
        ``lookup`` (a table, rows), reads those rows in the same RPCs and returns them."""
        handles = [h for h in handles if h.name not in self.lazy]
        if not handles and lookup is None:
            return None
        known = dict(self.ps_version)
        for handle in handles:
            if self.read_at.get(handle.name) != known.get(handle.ps):
                known[handle.ps] = -1  # a copy older than the rest: read them all
        looked_up = None
        with (
            AfterPush.outside(),
            timeline.span("ps read", "ps", {"variables": len(handles), "rows": lookup is not None}),
        ):
            if lookup is None:
                values, versions = self.ps.read_changed(handles, known)
            else:
                values, versions, looked_up = self.ps.read_changed_and_rows(handles, known, *lookup)
        with torch.no_grad():
            for i, handle in enumerate(handles):
                tensor = self.variables[handle.name]
                if i in values:
                    tensor.copy_(values[i])
                    self.read_at[handle.name] = versions[handle.ps]
                if handle.kind == "buffer":
                    self.buffers_read[handle.name] = tensor.detach().clone()
        self.ps_version.update(versions)
        return looked_up

    def _refresh_names(self, names: Sequence[str]) -> None:
        self.refresh([self.handles[n] for n in names])

    def _read_before_run(self, handles: Sequence[VariableHandle]) -> None:
        """Reads what a function uses before it runs; a function that looks rows up (and
        uses no buffers) reads its variables with its first lookup instead (`AfterPush`)."""
        dense = [h for h in handles if h.name not in self.lazy]
        if self.lazy and dense and all(h.kind != "buffer" for h in dense):
            self.after_push.add({h.name: self.variables[h.name] for h in dense})
        else:
            self.refresh(dense)

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

    def _pushed(self, handles: Sequence[VariableHandle], versions: dict[int, int]) -> None:
        """No values come back from a push: its variables are read again only if the function
        uses them after it (`AfterPush`), or by the next function."""
        self._updated([], [], versions)
        for handle in handles:
            self.read_at.pop(handle.name, None)
        self.after_push.add({h.name: self.variables[h.name] for h in handles})

    def buffer_changes(self) -> BufferChanges:
        """What the function changed in module buffers since they were read: the deltas the
        coordinator adds to the ps copies when it takes the function's result."""
        handles, deltas = [], []
        for name, read in self.buffers_read.items():
            tensor = self.variables[name]
            # by value: kernels such as batch_norm update running statistics without a version bump
            if not torch.equal(tensor, read):
                handles.append(self.handles[name])
                delta = tensor.detach() - read if tensor.dtype != torch.bool else tensor.detach().clone()
                deltas.append(delta)
        self.buffers_read.clear()
        return BufferChanges(handles, deltas)

    # ------------------------------------------------------------------ optimizer steps
    def push_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Sends the gradients of ``optimizer``'s variables to the ps tasks, which apply them
        with a copy of this optimizer, in one step (nothing comes back: see `_pushed`). Clears
        the gradients so the local ``step`` that follows changes nothing."""
        self.current.check_wanted("pushing its gradients to the ps tasks")
        with AfterPush.outside():
            self._push_gradients(optimizer)

    def _push_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        groups = [[self._handle_of(p) for p in group["params"]] for group in optimizer.param_groups]
        hyper = [hyperparameters(group) for group in optimizer.param_groups]
        key = optimizer_key(optimizer, groups)
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
        if handles or by_rows:  # one step over all, tables looked up by rows included
            with timeline.span("ps push", "ps", {"variables": len(handles) + len(by_rows)}):
                _, versions = self.ps.apply_gradients(
                    key, handles + by_rows, grads + row_grads, hyper, return_values=False
                )
            self._pushed(handles, versions)

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
    def dataset(self, dataset_id: str, pickled_fn: bytes) -> Any:
        """The per-worker dataset ``dataset_id``, made here on first use."""
        if dataset_id not in self.resources:
            fn = pickling.loads(pickled_fn)
            self.resources[dataset_id] = make_dataset(fn, self.num_workers, self.worker_index)
        return self.resources[dataset_id]

    def iterator(self, iterator_id: str, dataset_id: str, pickled_fn: bytes) -> WorkerIterator:
        """The per-worker iterator ``iterator_id`` (over dataset ``dataset_id``)."""
        if iterator_id not in self.resources:
            self.resources[iterator_id] = WorkerIterator(
                iter(self.dataset(dataset_id, pickled_fn)), self.worker_index
            )
        iterator = self.resources[iterator_id]
        assert isinstance(iterator, WorkerIterator)
        return iterator

    # ------------------------------------------------------------------ running
    def run(self, payload: bytes, header: dict[str, Any] | None = None) -> tuple[bool, bytes, BufferChanges]:
        """Runs one scheduled function: (True, pickled result, its buffer changes) or (False,
        pickled error, no changes). ``header``: the coordinator's ``closure``,
        ``heartbeat_timeout`` and ``fence`` (see `RunningClosure`)."""
        header = header or {}
        running = self.current.running(
            header.get("closure", 0), header.get("heartbeat_timeout"), header.get("fence")
        )
        with self._lock, context.running(self), running:
            self.used, self.lazy, self.lookups = {}, {}, {}
            try:
                fn, args, kwargs = pickling.loads(payload)
                self._read_before_run(list(self.used.values()))
                with self.strategy.scope():
                    result = fn(*args, **kwargs)
                return True, cloudpickle.dumps(_detached(result)), self.buffer_changes()
            except BaseException as exc:
                self.buffers_read.clear()
                error = pickling.dumps_exception(_with_remote_traceback(exc, self.worker_index))
                return False, error, BufferChanges([], [])
            finally:
                self.after_push.finish()

    def handlers(self) -> dict[str, Callable[[dict[str, Any], list[torch.Tensor]], Any]]:
        """The worker's RPC table: ``ping`` and ``run`` (payload and reply as one uint8 tensor,
        followed by the buffer deltas, whose variables the reply's header names)."""

        def ping(header: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
            self.current.heard(header.get("closure"))
            return {"worker": self.worker_index, **self.current.status()}, []

        def run(header: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
            ok, data, changes = self.run(tensors[0].numpy().tobytes(), header)
            reply = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return {"ok": ok, "buffers": changes.header()}, [reply, *changes.deltas]

        return {"ping": ping, "run": run}


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
