"""Every cross-worker collective verifies its partner: signed collectives and the mismatch report.

`WorkerGroup` signs each collective it issues (`CollectiveCheck.sign`): the n-th collective
of this worker, its kind (``all_reduce(SUM)``, ``broadcast(from 0)``, ``all_gather``), dtype and
element count become a 31-bit code (CRC-32 of the text, never Python's salted ``hash``) that
travels with the collective on every transport and is compared before any result reaches a
tensor: in the shared-memory segment's control block, in the first message of every gloo
collective (`phalanx.communication.transports.gloo.signed`), in every TLS ring frame's header. The call
site is not in the code (two workers may legitimately call the same collective from different
lines, e.g. the two branches of ``if rank == 0``), but it is in the report.

The first collective whose codes differ is a mismatch: the transport that saw it calls
`CollectiveCheck.mismatch`, which publishes this worker's signature in the chief's store,
reads the others' (every worker that saw a code differ does the same, at the same time) and
returns the `CollectiveMismatchError` naming every worker's collective and call site. This
costs a store round trip only when the job is already lost; on the hot path a check is a CRC
of a short string, the call-site walk, and a few bytes in the transport.

``PHALANX_COLLECTIVE_CHECK=0`` turns the codes off (for measuring the check; the stall
inspector still names stalls within its bound).
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch

from phalanx import settings
from phalanx.communication.checks.call_sites import call_site
from phalanx.communication.checks.signatures import Signature, WorkerState, dtype_name, shapes_of
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError

__all__ = ["CHECK_ENV", "CollectiveCheck", "Signed", "check_enabled", "codes_after"]

CHECK_ENV = "PHALANX_COLLECTIVE_CHECK"
REPORT_SECONDS = 3.0  # how long a worker that saw a mismatch waits for the others' signatures
_RECENT = 64  # collectives remembered for a peer's report
_KEY = "phalanx-mismatch/"
_HINT = (
    "HINT: make each collective on every worker or on none, with the same dtypes and sizes. The usual "
    "causes: a collective on some workers only (a rank-conditional strategy.reduce, log line, evaluation "
    "or torch.distributed call: call it everywhere, use the result on the chief), a step or backward "
    "skipped or repeated on one worker (decide together: reduce the flag first), a model built "
    "differently on one worker (docs/multi_worker.md, 'Mismatched collectives')."
)


def check_enabled() -> bool:
    """``PHALANX_COLLECTIVE_CHECK`` (1 by default; 0/false/off/no turns the codes off).

    Raises:
        ValueError: Another value (a typo must not silently drop the check).
    """
    return settings.current().collective_check


def code_of(seq: int, kind: str, tensor: torch.Tensor) -> int:
    """The 31-bit code of collective ``seq`` (1..2**31 - 1: 0 means "not checked")."""
    return _code(seq, kind, tensor.dtype, tensor.numel())


def _code(seq: int, kind: str, dtype: torch.dtype, numel: int) -> int:
    text = f"{seq}|{kind}|{dtype_name(dtype)}|{numel}"
    return (zlib.crc32(text.encode()) & 0x7FFFFFFF) or 1


def codes_after(seq: int, kind: str, specs: list[tuple[int, torch.dtype]]) -> list[int]:
    """The codes of collectives ``seq + 1, seq + 2, ...`` if they are ``kind`` of these element
    counts and dtypes."""
    return [_code(seq + 1 + i, kind, dtype, numel) for i, (numel, dtype) in enumerate(specs)]


@dataclass(frozen=True)
class Signed:
    """What a transport carries of a collective: its number and code (0: unchecked), and the
    full signature for the report."""

    seq: int
    code: int
    signature: Signature | None = None


UNCHECKED = Signed(0, 0)


class CollectiveCheck:
    """Signs this worker's collectives and reports the first mismatch (see the module doc).

    Args:
        rank, world_size: This worker and the number of workers.
        name: ``name(rank) -> "worker:1 (host:port)"``, for messages.
        enabled: Whether collectives carry codes (`check_enabled`).
        peer_state: A peer's last state from the stall inspector's gossip (names a peer that
            did not publish its side of a mismatch in time).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        name: Callable[[int], str],
        enabled: bool = True,
        peer_state: Callable[[int], WorkerState | None] = lambda peer: None,
    ) -> None:
        self._rank, self._world, self._name = rank, world_size, name
        self._peer_state = peer_state
        self.enabled = enabled
        self._seq = 0
        self._store: Any = None
        self._lock = threading.Lock()
        self._report: CollectiveMismatchError | None = None
        self._recent: dict[int, Signed] = {}  # the last collectives, for a peer's report

    def attach_store(self, store: Any) -> None:
        """The chief's store, where a mismatch's signatures are exchanged."""
        self._store = store

    @property
    def report(self) -> CollectiveMismatchError | None:
        """The mismatch this worker reported, once one was (sticky)."""
        return self._report

    def sign(self, kind: str, tensor: torch.Tensor, what: str, signature: Signature | None = None) -> Signed:
        """Signs the next collective (issued now, by every worker in the same order).

        Args:
            kind, tensor, what: The collective, its (first) tensor, what it is for.
            signature: Its stall-inspector signature when the inspector runs (same number).
        """
        self._seq += 1
        if not self.enabled:
            return Signed(self._seq, 0, signature)
        if signature is None:
            signature = Signature(self._seq, kind, what, call_site(), shapes_of((tensor,)))
        signed = Signed(self._seq, code_of(self._seq, kind, tensor), signature)
        self._recent[self._seq] = signed
        self._recent.pop(self._seq - _RECENT, None)
        return signed

    def upcoming_codes(self, kind: str, specs: list[tuple[int, torch.dtype]]) -> list[int]:
        """The codes that the next ``len(specs)`` collectives get if they are ``kind`` of these
        element counts and dtypes (after one more collective: the announcement itself)."""
        if not self.enabled:
            return [0] * len(specs)
        return codes_after(self._seq + 1, kind, specs)

    def peer_report(self) -> CollectiveMismatchError | None:
        """The report of a mismatch a peer saw (it published it in the store), joined by this
        worker's side; None when no peer reported one. Called once a collective failed (a
        peer that saw a mismatch closed its connections): a few store round trips."""
        if self._report is not None:
            return self._report
        if self._store is None or not self.enabled:
            return None
        # on a thread: a store cut off with its chief blocks, and a failure must never wait on it
        found: list[CollectiveMismatchError | None] = []
        reader = threading.Thread(target=lambda: found.append(self._read_peer_report()), daemon=True)
        reader.start()
        reader.join(2 * REPORT_SECONDS + 1)
        return found[0] if found else None

    def _read_peer_report(self) -> CollectiveMismatchError | None:
        try:
            if not self._store.check([_KEY + "first"]):
                return None
            seq = int(self._store.get(_KEY + "first"))
        except Exception:  # noqa: BLE001 (a store gone with its chief: nothing to join)
            return None
        signed = self._recent.get(seq)
        return None if signed is None else self.mismatch(signed)

    # ---------------------------------------------------------------- the report (failure path)
    def mismatch(
        self, signed: Signed, peer: int | None = None, then: Callable[[], None] | None = None
    ) -> CollectiveMismatchError:
        """The error of a collective whose codes differ (called by the transport that saw it,
        on every worker that saw it): names every worker's collective #seq and call site.

        Args:
            signed: This worker's collective.
            peer: A worker whose code differed, if the transport knows which.
            then: Called once this worker's side is in the store, before it waits for the
                others' (the TLS ring cuts its connections there, so that a neighbour blocked
                on this worker fails and joins the report).
        """
        with self._lock:
            if self._report is None:
                self._report = CollectiveMismatchError(self._describe(signed, peer, then))
            return self._report

    def _describe(self, signed: Signed, peer: int | None, then: Callable[[], None] | None) -> str:
        mine = signed.signature
        theirs = self._exchange(signed, then)
        own = mine.describe() if mine else f"collective #{signed.seq}"
        lines = [f"{self._name(self._rank)} issued {own}"]
        for rank in range(self._world):
            if rank == self._rank:
                continue
            other = theirs.get(rank) or self._gossiped(rank, signed.seq)
            if other is not None:
                lines.append(f"{self._name(rank)} issued {other.describe()}")
            elif peer is None or rank == peer:
                lines.append(f"{self._name(rank)} issued another collective (it did not say which in time)")
        return (
            "Every worker must call the same collectives, with the same dtypes and sizes, in the same "
            f"order, but collective #{signed.seq} differs between workers; no result of it was used. "
            f"Received: {'; '.join(lines)}. {_HINT}"
        )

    def _gossiped(self, peer: int, seq: int) -> Signature | None:
        state = self._peer_state(peer)
        if state is None:
            return None
        for signature in (state.waiting.signature if state.waiting else None, state.last):
            if signature is not None and signature.seq == seq:
                return signature
        return None

    def _exchange(self, signed: Signed, then: Callable[[], None] | None = None) -> dict[int, Signature]:
        """Publishes this worker's signature of #seq and reads the others' (within
        `REPORT_SECONDS`); the chief then waits (as long) until every worker has read, since
        the store lives in the chief's process."""
        if self._store is None or signed.signature is None:
            if then is not None:
                then()
            return {}
        key = f"{_KEY}{signed.seq}/"
        peers = [r for r in range(self._world) if r != self._rank]
        found: dict[int, Signature] = {}
        try:
            self._store.set(key + str(self._rank), json.dumps(asdict(signed.signature)))
            if not self._store.check([_KEY + "first"]):  # for peers that did not see it
                self._store.set(_KEY + "first", str(signed.seq))
            if then is not None:
                then()
            self._wait_for([key + str(r) for r in peers])
            for rank in peers:
                if self._store.check([key + str(rank)]):
                    found[rank] = Signature(**json.loads(self._store.get(key + str(rank))))
            self._store.set(f"{key}read/{self._rank}", "1")
            if self._rank == 0:
                self._wait_for([f"{key}read/{r}" for r in peers])
        except Exception:  # noqa: BLE001 (a store gone with its chief: report what is known)
            return found
        return found

    def _wait_for(self, keys: list[str]) -> None:
        deadline = time.monotonic() + REPORT_SECONDS
        while time.monotonic() < deadline and not self._store.check(keys):
            time.sleep(0.02)


def wait_timeout(seconds: float) -> timedelta:
    """A timedelta for store waits (at least 1 ms)."""
    return timedelta(seconds=max(seconds, 0.001))
