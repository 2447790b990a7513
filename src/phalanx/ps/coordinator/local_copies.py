"""The chief's copies of the variables that live on the ps tasks.

Parameters and buffers of modules created in ``strategy.scope()`` are placed on the ps
tasks, round-robin in creation order (TF's placement; a partitioner splits one into shards,
one per ps task in turn). The chief keeps each tensor as its local copy:

* it is **refreshed** from the ps tasks when a module created in scope runs forward or gives
  its ``state_dict()`` after scheduled functions may have changed the variables (`refresh`);
* what the chief **writes** into it (``load_state_dict``, in-place initialisation) is sent to
  the ps tasks before the next function is scheduled (`push_writes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from phalanx import _hooks
from phalanx.ps.partitioners import shard_rows
from phalanx.ps.variables import PSClient, VariableHandle

__all__ = ["LocalCopies"]

_all_copies: weakref.WeakSet[LocalCopies] = weakref.WeakSet()
_hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # modules given the hooks below
_forward_depth = threading.local()


class LocalCopies:
    """The chief's variables: where each lives on the ps tasks, and its local copy. Thread-safe.

    Args:
        ps: The client of the ps tasks.
        partitioner: Splits parameters along their first axis (`phalanx.partitioners`), or None.
        closures_pending: How many scheduled functions are queued or running (0 without a
            coordinator): while any is, the copies stay stale after a refresh.
    """

    def __init__(
        self, ps: PSClient, partitioner: Any, closures_pending: Callable[[], int] = lambda: 0
    ) -> None:
        self._ps = ps
        self._partitioner = partitioner
        self._closures_pending = closures_pending
        self._registry: dict[int, tuple[weakref.ref[torch.Tensor], VariableHandle]] = {}
        self._versions: dict[str, int] = {}  # each copy's version counter as last synced
        self._known: dict[str, tuple[str, int]] = {}  # what the synced copies hold, by ps variable
        self._count = 0
        self._colocate_ps: int | None = None  # set by `colocated_with` (colocate_vars_with)
        self._stale = False
        self._lock = threading.RLock()
        _all_copies.add(self)

    # ------------------------------------------------------------------ placement
    def place(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, kind: str) -> None:
        """Creates ``module.<name>`` (a "parameter" or a "buffer") on the ps tasks, with
        ``tensor``'s value, and keeps ``tensor`` as its local copy. A tensor already placed
        (tied weights) stays one variable."""
        with self._lock:
            if self.handle_of(tensor) is not None:
                return
            handle = self._handle(f"{type(module).__name__}.{name}", tensor, kind)
            if kind == "parameter" and isinstance(module, torch.nn.Embedding) and name == "weight":
                # workers read it by rows, split or not (TF's embedding_lookup on the ps)
                handle = dataclasses.replace(handle, kind="embedding")
            self._ps.create([handle], [tensor.detach()])
            self._registry[id(tensor)] = (weakref.ref(tensor), handle)
            self._versions[handle.name] = _hooks.tensor_version(tensor)
        if module not in _hooked:
            # module-level functions: the module is pickled with its hooks for every closure
            module.register_forward_pre_hook(_refresh_before_forward)
            module.register_forward_hook(_after_forward, always_call=True)
            module.register_state_dict_pre_hook(_refresh_before_state_dict)
            _hooked.add(module)

    def _handle(self, name: str, tensor: torch.Tensor, kind: str) -> VariableHandle:
        """The next variable's place: the next ps task, round-robin; a parameter the
        partitioner splits gets one shard per ps task in turn."""

        def place(shape: tuple[int, ...], label: str) -> VariableHandle:
            ps = self._count % self._ps.num_ps if self._colocate_ps is None else self._colocate_ps
            handle = VariableHandle(
                name=f"{self._count}/{label}",
                ps=ps,
                shape=shape,
                dtype=str(tensor.dtype),
                kind=kind,
                requires_grad=bool(tensor.requires_grad),
            )
            self._count += 1
            return handle

        shards = 1
        colocated = self._colocate_ps is not None  # one ps task holds it whole
        if self._partitioner is not None and kind == "parameter" and tensor.dim() >= 1 and not colocated:
            shards = int(self._partitioner(tuple(tensor.shape), tensor.dtype)[0])
        if shards <= 1:
            return place(tuple(tensor.shape), name)
        rest = tuple(tensor.shape[1:])
        parts = tuple(
            place((stop - start, *rest), f"{name}/part_{i}")
            for i, (start, stop) in enumerate(shard_rows(tensor.shape[0], shards))
        )
        whole = f"{parts[0].name}/whole"
        return dataclasses.replace(parts[0], name=whole, shape=tuple(tensor.shape), shards=parts)

    @contextlib.contextmanager
    def colocated_with(self, tensor: torch.Tensor) -> Iterator[None]:
        """Variables placed inside go whole to the ps task of ``tensor`` (one of these copies;
        a partitioned one: its first shard's task), not round-robin."""
        handle = self.handle_of(tensor)
        if handle is None:
            raise ValueError(f"{type(tensor).__name__} is not a variable of this ParameterServerStrategy.")
        with self._lock:
            previous, self._colocate_ps = self._colocate_ps, handle.ps
        try:
            yield
        finally:
            with self._lock:
                self._colocate_ps = previous

    def handle_of(self, tensor: torch.Tensor) -> VariableHandle | None:
        """The handle of ``tensor`` if it is one of these copies, else None."""
        entry = self._registry.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def owns(self, module: torch.nn.Module) -> bool:
        """Whether a parameter or buffer of ``module`` is one of these copies."""
        with self._lock:
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            return any(id(t) in self._registry for _, t in own)

    def live(self) -> list[tuple[torch.Tensor, VariableHandle]]:
        """Every copy still alive, with its handle (forgets the collected ones)."""
        with self._lock:
            out = []
            for key, (ref, handle) in list(self._registry.items()):
                tensor = ref()
                if tensor is None:
                    del self._registry[key]
                else:
                    out.append((tensor, handle))
            return out

    # ------------------------------------------------------------------ synchronisation
    def _unwritten(self, tensor: torch.Tensor, handle: VariableHandle) -> bool:
        """Whether nothing was written into ``tensor`` since it was last synced."""
        return _hooks.tensor_version(tensor) == self._versions.get(handle.name)

    def mark_stale(self) -> None:
        """Scheduled functions may have changed the variables: the next `refresh` reads them."""
        self._stale = True

    def refresh(self) -> None:
        """Brings every copy up to the ps tasks' values if scheduled functions may have changed
        them (blocks on one read per ps task). Only what changed since the last refresh comes:
        a variable nobody wrote stays, a table only row gradients wrote gets those rows (a copy
        the chief wrote into since is read whole). The copies stay stale while functions are pending."""
        if not self._stale:
            return
        with self._lock:
            if self._closures_pending() == 0:
                self._stale = False
            pairs = self.live()
            if not pairs:
                return
            known = {
                shard.name: self._known[shard.name]
                for tensor, handle in pairs
                if self._unwritten(tensor, handle)
                for shard in handle.physical()
                if shard.name in self._known
            }
            patches, self._known = self._ps.read_since([h for _, h in pairs], known)
            with torch.no_grad():
                for position, (tensor, handle) in enumerate(pairs):
                    for patch in patches.get(position, ()):
                        patch.apply(tensor)
                    self._versions[handle.name] = _hooks.tensor_version(tensor)

    def push_writes(self) -> None:
        """Sends what the chief wrote into its copies since they were last synced to the ps
        tasks (one write per ps task; nothing when nothing changed)."""
        with self._lock:
            changed = [(t, h) for t, h in self.live() if not self._unwritten(t, h)]
            if changed:
                self._ps.write("assign", [h for _, h in changed], [t.detach() for t, _ in changed])
                for tensor, handle in changed:
                    self._versions[handle.name] = _hooks.tensor_version(tensor)


# ---------------------------------------------------------------------- module hooks
def _owner(module: torch.nn.Module) -> LocalCopies | None:
    return next((copies for copies in list(_all_copies) if copies.owns(module)), None)


def _refresh_before_forward(module: torch.nn.Module, args: Any) -> None:
    depth = getattr(_forward_depth, "value", 0)
    _forward_depth.value = depth + 1
    if depth == 0 and _all_copies:  # the outermost module refreshes them all, once
        copies = _owner(module)
        if copies is not None:
            copies.refresh()


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    _forward_depth.value = max(getattr(_forward_depth, "value", 1) - 1, 0)


def _refresh_before_state_dict(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
    if _all_copies:
        copies = _owner(module)
        if copies is not None:
            copies.refresh()
