"""Signs every collective of a `WorkerGroup` and keeps the stall inspector informed.

`WorkerGroup` calls `issue` when a collective starts (its kind, what it is for, the call site
and the shapes/dtypes of its tensors become a `Signature`), `begin_wait`/`end_wait` around
the wait for it, and reads `verdict` while it waits. The heartbeat thread carries the
tracker's state to the peers (`StallInspector` is the heartbeat's gossip), so nothing here
talks to another worker on the hot path. With ``PHALANX_DISTRIBUTED_DEBUG=DETAIL`` every
collective is first compared across workers through the chief's store (one store round trip
per collective: a debug mode), and the first mismatch is named.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch

from phalanx.communication.checks.call_sites import call_site
from phalanx.communication.checks.signatures import CollectiveTracker, Signature, shapes_of
from phalanx.communication.checks.stall_inspector import (
    DEBUG_ENV,
    MISMATCH_HINT,
    CollectiveMismatchError,
    StallInspector,
    StallSettings,
)

__all__ = ["CollectiveWatch"]

_MAX_PENDING = 4096  # signatures of works never waited for (abandoned rounds) are dropped


class CollectiveWatch:
    """This worker's collective signatures, their waits, and the inspector's verdict.

    Args:
        rank, world_size: This worker and the number of workers.
        name: ``name(rank) -> "worker:1 (host:port)"``, for messages.
        settings: The bounds and switches (`StallSettings.from_env`).
        clock: Monotonic clock (a fake one in tests).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        name: Callable[[int], str],
        settings: StallSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rank, self._world, self._name = rank, world_size, name
        self.settings = settings
        self.tracker = CollectiveTracker(clock)
        self.inspector = StallInspector(rank, world_size, name, self.tracker, settings, clock)
        self._pending: dict[int, tuple[Any, Signature]] = {}  # id(work) -> (work, its signature)
        self._store: Any = None
        self._suspected: str | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def verdict(self) -> str | None:
        """The inspector's mismatch verdict, once every worker's states showed one."""
        return self.inspector.verdict

    def publish_initial(self, store: Any) -> None:
        """Writes this worker's (empty) state before it checks in, so that every worker's key
        exists before the first heartbeat round reads them; keeps ``store`` for DETAIL checks."""
        self._store = store
        store.set(StallInspector.key(self._rank), self.inspector.initial())

    # ---------------------------------------------------------------- issuing
    def issue(self, kind: str, tensors: Sequence[torch.Tensor], what: str) -> Signature | None:
        """Signs a collective issued now (None when the inspector is off).

        Raises:
            CollectiveMismatchError: (DETAIL) another worker's collective of the same number
                differs in kind, shapes or dtypes.
        """
        if not self.settings.enabled:
            return None
        signature = self.tracker.issue(kind, what, call_site(), shapes_of(tensors))
        if self.settings.debug and self._store is not None:
            self._compare_everywhere(signature)
        return signature

    def attach(self, work: Any, signature: Signature | None) -> Any:
        """Remembers which collective ``work`` is (for `begin_wait`); returns ``work``."""
        if signature is not None:
            if len(self._pending) >= _MAX_PENDING:
                self._pending.pop(next(iter(self._pending)))
            self._pending[id(work)] = (work, signature)
        return work

    # ---------------------------------------------------------------- waiting
    def begin_wait(self, work: Any, what: str, where_issued: bool = False) -> None:
        """This worker blocks in ``work``'s collective from now (called by `WorkerGroup.wait`).

        ``where_issued``: the wait is at the call site that issued it (a blocking collective),
        so the stack is not walked twice.
        """
        entry = self._pending.pop(id(work), None)
        if entry is not None:
            signature = entry[1]
            self.tracker.begin_wait(signature, what, signature.site if where_issued else call_site())

    def begin_wait_at_issue(self, signature: Signature | None, what: str) -> None:
        """This worker may block in the collective it issues now, at its call site (a call a
        transport runs on the issuing thread); `end_wait` after it returns."""
        if signature is not None:
            self.tracker.begin_wait(signature, what, signature.site)

    def end_wait(self) -> None:
        """The wait ended."""
        if self.tracker.waiting is not None:
            self.tracker.end_wait()

    def begin_closing(self) -> None:
        """This worker closes its strategy: it issues nothing more."""
        if self.settings.enabled:
            self.tracker.begin_closing(call_site())

    def suspicion(self) -> str | None:
        """The mismatch the last states show, however short (see `StallInspector.suspicion`)."""
        if not self.settings.enabled:
            return None
        self._suspected = self.inspector.suspicion()
        return self._suspected

    def explains(self, failure: str | None) -> bool:
        """Whether ``failure`` is this watch's verdict or suspicion (a mismatch)."""
        return failure is not None and failure in (self.inspector.verdict, self._suspected)

    def error(self) -> CollectiveMismatchError | None:
        """The error every worker raises once the inspector decided (None before)."""
        verdict = self.inspector.verdict
        return None if verdict is None else CollectiveMismatchError(verdict)

    # ---------------------------------------------------------------- DETAIL
    def _compare_everywhere(self, signature: Signature) -> None:
        """Publishes ``signature`` under its number and compares it with every peer's."""
        key = f"detail/{signature.seq}/"
        self._store.set(key + str(self._rank), json.dumps(asdict(signature)))
        peers = [r for r in range(self._world) if r != self._rank]
        try:
            self._store.wait([key + str(r) for r in peers], timedelta(seconds=self.settings.timeout))
        except RuntimeError:  # a peer issued no collective #seq within the bound
            missing = [self._name(r) for r in peers if not self._store.check([key + str(r)])]
            raise CollectiveMismatchError(
                f"Every worker must call the same collectives in the same order ({DEBUG_ENV}=DETAIL), "
                f"but {missing} issued no collective #{signature.seq} within {self.settings.timeout:g}s. "
                f"Received: {self._name(self._rank)} issued {signature.describe()}. {MISMATCH_HINT}"
            ) from None
        for peer, raw in zip(peers, self._store.multi_get([key + str(r) for r in peers]), strict=True):
            theirs = Signature(**json.loads(raw))
            if not theirs.matches(signature):
                raise CollectiveMismatchError(
                    "Every worker must call the same collectives, with the same shapes and dtypes, in "
                    f"the same order ({DEBUG_ENV}=DETAIL), but collective #{signature.seq} differs. "
                    f"Received: {self._name(self._rank)} issued {signature.describe()}; "
                    f"{self._name(peer)} issued {theirs.describe()}. {MISMATCH_HINT}"
                )
