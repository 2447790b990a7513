"""What each worker's collectives are and where it is now: signatures and worker states.

A `Signature` is recorded by `WorkerGroup` when a collective is issued: its kind, sequence
number (the n-th collective this worker issued), what it is for, the call site and the
shapes/dtypes. A `CollectiveTracker` keeps this worker's last issued signature and the one it
waits in; its `WorkerState` travels to the other workers through the heartbeat channel
(`phalanx.communication.checks.health`) and is read by the stall inspector.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["CollectiveTracker", "Signature", "WorkerState", "shapes_of"]


def shapes_of(tensors: Sequence[torch.Tensor]) -> str:
    """``"float32[4,8]"`` (tensors joined by ``+``): cheap, and equal exactly when they match."""
    return "+".join(_shape_text(t.dtype, t.shape) for t in tensors)


@functools.lru_cache(maxsize=64)
def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32`` (str of a dtype is slow: every signed collective asks)."""
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=4096)  # a training loop signs the same few shapes every step
def _shape_text(dtype: torch.dtype, shape: torch.Size) -> str:
    return f"{dtype_name(dtype)}[{','.join(map(str, shape))}]"


@dataclass(frozen=True)
class Signature:
    """One issued collective (see the module doc).

    Args:
        seq: Its number among the collectives this worker issued (1, 2, ...): the same on every
            worker for the collectives that match.
        kind: ``"all_reduce(SUM)"``, ``"broadcast(from 0)"``, ``"all_gather"``.
        what: What it is for (``"the gradient all-reduce"``, ``"all_reduce"``).
        site: Where it was issued (`phalanx.communication.checks.call_sites.call_site`).
        shapes: `shapes_of` its tensors.
    """

    seq: int
    kind: str
    what: str
    site: str
    shapes: str

    def matches(self, other: Signature) -> bool:
        """Whether two workers' collectives can meet: same number, kind, shapes and dtypes."""
        return (self.seq, self.kind, self.shapes) == (other.seq, other.kind, other.shapes)

    def describe(self, what: str | None = None, waited_at: str | None = None) -> str:
        """``"the gradient all-reduce #42 (loss.backward at train.py:65; waited for in
        optimizer.step at train.py:67) [all_reduce(SUM) of float32[1034]]"``."""
        where = self.site if waited_at in (None, self.site) else f"{self.site}; waited for in {waited_at}"
        return f"{what or self.what} #{self.seq} ({where}) [{self.kind} of {self.shapes}]"


@dataclass(frozen=True)
class Waiting:
    """The collective a worker is blocked in, what the wait is for and where it waits."""

    signature: Signature
    what: str
    site: str

    def describe(self) -> str:
        return self.signature.describe(self.what, self.site)


@dataclass(frozen=True)
class WorkerState:
    """What peers know of one worker: collectives issued, the last one, the one it waits in,
    and whether it is closing its strategy (then where)."""

    issued: int = 0
    last: Signature | None = None
    waiting: Waiting | None = None
    closing: str | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(data: bytes) -> WorkerState:
        raw: dict[str, Any] = json.loads(data)
        last = Signature(**raw["last"]) if raw.get("last") else None
        waiting = raw.get("waiting")
        if waiting:
            waiting = Waiting(Signature(**waiting["signature"]), waiting["what"], waiting["site"])
        return WorkerState(int(raw.get("issued", 0)), last, waiting or None, raw.get("closing"))

    def describe(self) -> str:
        """``"waits in <collective>"`` / ``"is closing ..."`` / ``"has issued no collective"``."""
        after = (
            f"its last collective was {self.last.describe()}" if self.last else "it issued no collective yet"
        )
        if self.waiting is not None:
            return f"waits in {self.waiting.describe()}"
        if self.closing is not None:
            return f"is closing its strategy ({self.closing}); {after}"
        return f"is not in a collective (it computes, or took another path); {after}"


class CollectiveTracker:
    """This worker's collectives, as its peers should see them (see the module doc).

    Written by the threads that issue and wait for collectives, read by the heartbeat thread
    (`state`); plain attribute writes, no lock: a state read between two writes is at most one
    collective stale, and the next heartbeat round publishes the rest.

    Args:
        clock: Monotonic clock (a fake one in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._counter = itertools.count(1)
        self.issued = 0
        self.last: Signature | None = None
        self.waiting: Waiting | None = None
        self.waiting_since = 0.0
        self.closing: str | None = None
        self.version = 0  # changes with every write: the heartbeat publishes only a new state

    def issue(self, kind: str, what: str, site: str, shapes: str) -> Signature:
        """Records a collective issued now and returns its signature (numbered in issue order)."""
        signature = Signature(next(self._counter), kind, what, site, shapes)
        self.issued, self.last = signature.seq, signature
        self.version += 1
        return signature

    def begin_wait(self, signature: Signature, what: str, site: str) -> None:
        """This worker blocks in ``signature``'s collective (``what``, at ``site``) from now."""
        self.waiting_since = self._clock()
        self.waiting = Waiting(signature, what, site)
        self.version += 1

    def end_wait(self) -> None:
        """The wait ended (the collective finished or failed)."""
        self.waiting = None
        self.version += 1

    def begin_closing(self, site: str) -> None:
        """This worker closes its strategy (it will issue no more collectives)."""
        self.closing = site
        self.version += 1

    def waited(self) -> float | None:
        """Seconds this worker has been waiting in its current collective (None: not waiting)."""
        return None if self.waiting is None else self._clock() - self.waiting_since

    def state(self) -> WorkerState:
        """A snapshot for the peers."""
        return WorkerState(self.issued, self.last, self.waiting, self.closing)
