"""The launcher's side of an elastic job (``phalanx launch --min-workers M [--max-restarts K]``).

The launcher serves the rendezvous store itself (so losing any worker, the chief included,
keeps it), tells the tasks where it is (``PHALANX_ELASTIC_STORE``) and the minimum
(``PHALANX_MIN_WORKERS``), and watches the trainer processes: one that exits with an error
is marked ``dead`` in the store at once (the survivors re-form without waiting for a
heartbeat to time out), the time it left is logged, and it is started again while restarts
remain (``PHALANX_ELASTIC_INCARNATION`` counts them; a restarted task joins the running job at
the next step boundary), unless a trainer has finished already (the job is ending). The job
fails once fewer trainers than the minimum are left; it succeeds when every trainer still in
it exited 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from phalanx.cluster._supervisor import Decision, Outcome, TaskState, describe_exit

__all__ = ["BELOW_MINIMUM_GRACE", "ElasticLaunch", "elastic_states"]

BELOW_MINIMUM_GRACE = 10.0  # seconds the survivors get to stop with their own error below the minimum


class ElasticLaunch:
    """Serves the store and keeps the membership of one elastic launch (the launcher's).

    Args:
        min_workers: The job stops below this many trainers.
        max_restarts: How many restarts of lost trainers in all (0: none).
        token: The cluster token (the store's values are authenticated with it).
        note: Prints a launcher message.
    """

    def __init__(self, min_workers: int, max_restarts: int, token: str, note: Callable[[str], None]) -> None:
        import torch.distributed as dist  # only elastic launches need torch in the launcher

        from phalanx.cluster._ports import free_ports
        from phalanx.communication.membership.membership import PREFIX
        from phalanx.communication.membership.rendezvous import AuthenticatedStore, listening_socket

        self.min_workers, self.max_restarts, self._note = min_workers, max_restarts, note
        self.restarts = 0
        self._left: set[str] = set()  # trainers that left the job for good
        self._handled: dict[str, int] = {}  # name -> pid whose exit was handled
        self._incarnation: dict[str, int] = {}
        self._below_since: float | None = None
        (port,) = free_ports(1, "127.0.0.1")
        # on the loopback address only, as an IPv4 socket: TCPStore alone listens on every
        # interface, as IPv6, and looks up the name of each client's (v4-mapped) address on its
        # one event loop, which no /etc/hosts line for 127.0.0.1 answers: a DNS query left
        # unanswered there held every worker's calls for 5 s
        self._server = dist.TCPStore(
            "127.0.0.1",
            port,
            None,
            is_master=True,
            timeout=timedelta(seconds=30),
            wait_for_workers=False,
            master_listen_fd=listening_socket("127.0.0.1", port),
        )
        self.address = f"127.0.0.1:{port}"
        self._store = AuthenticatedStore(dist.PrefixStore(PREFIX, self._server), token, PREFIX)
        self._started = time.monotonic()

    def environment(self) -> dict[str, str]:
        """The variables every task gets: where the store is and the minimum. (Shared memory
        stays on: a re-formed group agrees on fresh segments, `open_transports`.)"""
        from phalanx.communication.membership.membership import ELASTIC_STORE_ENV, MIN_WORKERS_ENV

        return {MIN_WORKERS_ENV: str(self.min_workers), ELASTIC_STORE_ENV: self.address}

    def incarnation_env(self, name: str) -> dict[str, str]:
        """The variable that tells a (re)started task its incarnation."""
        from phalanx.communication.membership.membership import INCARNATION_ENV

        return {INCARNATION_ENV: str(self._incarnation.get(name, 0))}

    def _stamp(self) -> str:
        return f"{time.strftime('%H:%M:%S')} (+{time.monotonic() - self._started:.1f}s)"

    def handle_exits(
        self, states: Sequence[tuple[TaskState, int, int]], restart: Callable[[str], None]
    ) -> None:
        """Marks trainers that exited with an error as lost, and restarts them while restarts
        remain. ``states``: (state, pid, rank) of each trainer."""
        for state, pid, rank in states:
            code = state.returncode
            if code is None or code == 0 or self._handled.get(state.name) == pid or state.name in self._left:
                continue
            self._handled[state.name] = pid
            self._store.set(f"alive/{rank}", "dead")
            alive = sum(1 for s, _, _ in states if s.returncode is None)
            self._note(
                f"elastic: {state.name} left at {self._stamp()} with code {code}{describe_exit(code)}; "
                f"{alive} workers train on (minimum {self.min_workers})."
            )
            finishing = any(s.returncode == 0 for s, _, _ in states)  # the members end together
            if self.restarts < self.max_restarts and self._below_since is None and not finishing:
                self.restarts += 1
                self._incarnation[state.name] = self._incarnation.get(state.name, 0) + 1
                self._note(
                    f"elastic: restarting {state.name} (restart {self.restarts} of {self.max_restarts}); "
                    "it joins at the next step boundary."
                )
                restart(state.name)
            else:
                self._left.add(state.name)

    def decide(self, states: Sequence[TaskState]) -> Decision | None:
        """The elastic rules before the launcher's usual ones: None to apply those to the
        trainers still in the job (`kept`). Below the minimum, the survivors get
        `BELOW_MINIMUM_GRACE` seconds to stop with their own error, then the job fails."""
        trainers = [s for s in states if s.is_trainer and s.name not in self._left]
        if len(trainers) >= self.min_workers:
            return None
        if self._below_since is None:
            self._below_since = time.monotonic()
        waiting = any(s.returncode is None for s in trainers)
        if waiting and time.monotonic() - self._below_since < BELOW_MINIMUM_GRACE:
            return None  # the survivors stop with BelowMinimumWorkersError themselves
        return Decision(
            Outcome.FAILED,
            1,
            f"elastic: fewer than --min-workers {self.min_workers} workers are left; stopping the job.",
        )

    def kept(self, states: Sequence[TaskState]) -> list[TaskState]:
        """The tasks still in the job (not the trainers that left it)."""
        return [s for s in states if s.name not in self._left]

    def close(self) -> None:
        """Stops serving the store (after every task has stopped)."""
        self._store = self._server = None  # type: ignore[assignment]


def elastic_states(running: Sequence[Any]) -> list[tuple[TaskState, int, int]]:
    """(state, pid, rank) of each trainer of ``running`` (the launcher's `_Running` records)."""
    return [
        (r.state(), r.process.pid, int(r.task.env["RANK"]))
        for r in running
        if r.task.is_trainer and "RANK" in r.task.env
    ]
