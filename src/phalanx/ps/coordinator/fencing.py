"""Fences: a ps task refuses what a function the coordinator gave up on still sends.

A worker cut off by a network partition is counted lost by the coordinator, which runs its
function again on another worker. The first run may still reach the ps tasks: a write it sent
just before the cut arrives when the link heals (TCP delivers it late), or the worker goes on
writing once it can. Applied, such a write would count its examples twice.

So every run of a function carries a tag, ``[coordinator session, worker index, run]``, and the
worker sends it with each call it makes to a ps task for that function (`TaggedRpcClient`).
Before the coordinator runs a function again, it *fences* the abandoned run on every ps task
(`Fences`, the ``fence`` method): each ps task then refuses every call tagged with that run,
or an earlier run of that worker in that session, with `FencedRunError`. A later run on the
same worker has a higher number and goes through. Calls without a tag (the chief's own) are
never refused.

Module buffers (metric states, BatchNorm statistics) are never written by the worker: their
changes come back with the function's result and the coordinator adds them when it takes the
result (`phalanx.ps.variables.BufferChanges`), so a function whose reply was lost adds them
once, through its rerun. What remains: a gradient push that arrived just before the cut, from
a function whose reply did not, is applied again by the rerun (TF's rule: at least once); the
window is the time between that push and the reply.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from phalanx.ps.coordinator.deadlines import ps_call_timeout
from phalanx.ps.transport import Handler, RpcClient

__all__ = ["FENCE_KEY", "FencedRunError", "Fences", "TaggedRpcClient"]

FENCE_KEY = "fence"  # header key of a tagged call: [session, worker, run]


class FencedRunError(RuntimeError):
    """A ps task refused a call of a function run the coordinator gave up on."""


class Fences:
    """A ps task's fences, by (session, worker): the highest run fenced. Thread-safe.

    Args:
        name: The ps task, for messages.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._fenced: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def fence(self, session: str, worker: int, run: int) -> None:
        """Refuses, from now on, calls tagged with ``run`` or an earlier run of ``worker``."""
        with self._lock:
            key = (session, worker)
            self._fenced[key] = max(run, self._fenced.get(key, 0))

    def check(self, tag: Sequence[Any], method: str) -> None:
        """Raises if ``tag`` (``[session, worker, run]``) is fenced.

        Raises:
            FencedRunError: The coordinator gave that run up (naming the worker and the run).
        """
        session, worker, run = str(tag[0]), int(tag[1]), int(tag[2])
        with self._lock:
            fenced = self._fenced.get((session, worker), 0)
        if run <= fenced:
            raise FencedRunError(
                f"{self.name} refused {method} from worker:{worker} for run {run}: the coordinator counted "
                "that worker lost and runs the function on another worker. Received: a call of an abandoned "
                "run (sent before a network partition, or after it healed). HINT: nothing to do; the "
                "function's other run applies its changes once."
            )

    def guard(self, handlers: Mapping[str, Handler]) -> dict[str, Handler]:
        """``handlers`` refusing fenced calls, plus the ``fence`` method: ``{"session",
        "worker", "run"}`` -> ``{}``."""
        guarded: dict[str, Handler] = {name: self._guarded(name, h) for name, h in handlers.items()}
        guarded["fence"] = self._rpc_fence
        return guarded

    def _guarded(self, method: str, handler: Handler) -> Handler:
        def call(header: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
            tag = header.pop(FENCE_KEY, None)
            if tag is not None:
                self.check(tag, method)
            return handler(header, tensors)

        return call

    def _rpc_fence(
        self, header: dict[str, Any], tensors: list[torch.Tensor]
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        self.fence(str(header["session"]), int(header["worker"]), int(header["run"]))
        return {}, []


class TaggedRpcClient(RpcClient):
    """A worker's connection to a ps task: each call carries the tag of the function run in
    progress (``tag()``; None: no tag). Arguments after ``tag`` are `RpcClient`'s; its calls'
    deadline defaults to `ps_call_timeout()`."""

    def __init__(self, *args: Any, tag: Callable[[], list[Any] | None], **kwargs: Any) -> None:
        kwargs.setdefault("timeout", ps_call_timeout())
        super().__init__(*args, **kwargs)
        self._tag = tag

    def _tagged(self, header: Mapping[str, Any] | None) -> dict[str, Any]:
        tag = self._tag()
        return dict(header or {}) if tag is None else {**(header or {}), FENCE_KEY: tag}

    def call(self, method: str, header: Mapping[str, Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """`RpcClient.call` with the run's tag in the header."""
        return super().call(method, self._tagged(header), *args, **kwargs)

    def start(self, method: str, header: Mapping[str, Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """`RpcClient.start` with the run's tag in the header."""
        return super().start(method, self._tagged(header), *args, **kwargs)

    def begin(self, method: str, header: Mapping[str, Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """`RpcClient.begin` with the run's tag in the header."""
        return super().begin(method, self._tagged(header), *args, **kwargs)
