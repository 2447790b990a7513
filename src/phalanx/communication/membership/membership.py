"""Elastic membership of a MultiWorkerMirrored job: which tasks train together, epoch by epoch.

Opt-in (``PHALANX_MIN_WORKERS``; ``phalanx launch --min-workers`` sets it). The job's
rendezvous store must outlive every worker (``PHALANX_ELASTIC_STORE=host:port``, which
``phalanx launch`` serves itself), because the chief may be the one that is lost.

A **membership epoch** is one process group: its members, in rank order (the members that stay,
by task, then the joiners, by task: rank 0, the chief, is the lowest live task that was a
member already, never a task that just joined), are written once, under
``phalanx/elastic/e/<epoch>/members``, and its `WorkerGroup` uses the key prefix
``phalanx/elastic/g<epoch>/`` (fresh gloo, stall-inspector and heartbeat keys; on torchrun's
agent store ``phalanx/elastic/r<restart>/`` stands for ``phalanx/elastic/``, see
`ElasticSettings.prefix`). Each member is a ``task:incarnation`` pair: a restarted task is a
new incarnation, which joins as a new member.

* **Beacons.** Every worker adds to ``alive/<task>`` every `BEACON_SECONDS` on a thread of
  its own (``incarnation:count``); the launcher writes ``dead`` there when the process exits.
  A member whose beacon says ``dead``, names another incarnation, or has not moved for
  ``PHALANX_ELASTIC_DEAD_SECONDS`` (3 s) is lost; the watcher thread reports it to the group
  (`Membership.failure`), so a collective that waits for it fails within half a second.
* **The first formation** (`Membership.start`, every task of incarnation 0) works as a
  re-form does, over every task of the cluster: the decider waits until each checked in or is
  lost (or for the join timeout), so a task lost before the first step does not hold the
  others; it joins (restarted) at the first step boundary. A task that comes after the first
  group formed without it joins likewise.
* **Re-forming** (`Membership.reform`, every survivor): each checks in under the next epoch;
  the first to check in decides: it waits until every old member checked in or is lost,
  adds the tasks waiting to join, writes the members and moves ``epoch`` on (a decider lost
  before it wrote them is replaced by the next survivor that notices).
* **Joining** (`Membership.join`, a restarted task): it writes ``join/<task>``; the members
  see it at the next step boundary (`Membership.join_pending`) and re-form with it.

Below ``min_workers`` members, `BelowMinimumWorkersError` ends the job, naming who is left.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx import settings
from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.membership.beacons import STORE_CALL_SECONDS, Beacons, Member, Wait
from phalanx.communication.membership.named_store import NamedStore, store_unavailable
from phalanx.communication.membership.rendezvous import _authenticated

__all__ = [
    "BEACON_SECONDS",
    "DEAD_AFTER_ENV",
    "ELASTIC_STORE_ENV",
    "INCARNATION_ENV",
    "MIN_WORKERS_ENV",
    "BelowMinimumWorkersError",
    "ElasticSettings",
    "Member",
    "Membership",
]

log = logging.getLogger("phalanx")

MIN_WORKERS_ENV = "PHALANX_MIN_WORKERS"
ELASTIC_STORE_ENV = "PHALANX_ELASTIC_STORE"
INCARNATION_ENV = "PHALANX_ELASTIC_INCARNATION"
DEAD_AFTER_ENV = "PHALANX_ELASTIC_DEAD_SECONDS"
PREFIX = "phalanx/elastic/"
BEACON_SECONDS = 0.2
DEFAULT_DEAD_AFTER = 3.0
STOP_SECONDS = 5.0  # the watcher's longest round: a few store calls (milliseconds)
DECIDE_MARGIN = 5.0  # seconds those who wait for a decision allow beyond the decider's timeout


class BelowMinimumWorkersError(PeerUnavailableError):
    """Fewer workers are left than an elastic job's ``min_workers``: the job stops."""


@dataclass(frozen=True)
class ElasticSettings:
    """What an elastic job needs, from the environment (`from_env`).

    Attributes:
        store: ``(host, port)`` of a TCPStore that outlives every worker.
        min_workers: The job stops below this many workers.
        incarnation: How many times the launcher restarted this task (0: first start).
        dead_after: Seconds without a beacon after which a member counts as lost.
        prefix: The prefix of the job's keys: `PREFIX`, or ``phalanx/elastic/r<n>/`` on
            torchrun's agent store, which outlives torchrun's restarts (restart ``n`` of
            ``TORCHELASTIC_RESTART_COUNT`` forms anew, unseen by the keys of the one before).
    """

    store: tuple[str, int]
    min_workers: int
    incarnation: int = 0
    dead_after: float = DEFAULT_DEAD_AFTER
    prefix: str = PREFIX

    @classmethod
    def from_env(cls) -> ElasticSettings | None:
        """The settings of an elastic job, or None when ``PHALANX_MIN_WORKERS`` is unset.

        Raises:
            ValueError: A malformed value, or no store that outlives the workers.
        """
        knobs = settings.current()
        minimum = knobs.text(MIN_WORKERS_ENV)
        if not minimum:
            return None
        address, prefix = knobs.text(ELASTIC_STORE_ENV), PREFIX
        if not address and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            address = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
            prefix = f"{PREFIX}r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        host, _, port = address.rpartition(":")
        if not minimum.isdigit() or int(minimum) < 1 or not host or not port.isdigit():
            raise ValueError(
                f"An elastic job ({MIN_WORKERS_ENV}) needs a positive minimum and a rendezvous store that "
                f"outlives every worker ({ELASTIC_STORE_ENV}=host:port). Received: {MIN_WORKERS_ENV}="
                f"{minimum!r}, {ELASTIC_STORE_ENV}={address!r}. HINT: `phalanx launch --min-workers M` "
                "sets both (docs/multi_worker.md, Elastic training)."
            )
        dead_after = knobs.seconds(DEAD_AFTER_ENV, DEFAULT_DEAD_AFTER)
        incarnation = int(knobs.text(INCARNATION_ENV))
        return cls((host.strip("[]"), int(port)), int(minimum), incarnation, dead_after, prefix)


def _members_text(members: Sequence[Member]) -> str:
    return ",".join(str(m) for m in members)


def _parse_members(raw: bytes) -> list[Member]:
    text = raw.decode()
    return [Member.parse(m) for m in text.split(",")] if text else []


class Membership:
    """This task's view of the elastic membership (every worker makes one, before its group).

    Args:
        settings: The `ElasticSettings`.
        task: This task's index among the cluster's training tasks.
        num_tasks: How many training tasks the cluster has.
        name: ``name(task) -> "worker:1 (host:port)"``, for messages.
        timeout: Seconds to wait for a decision (joining, re-forming).
    """

    def __init__(
        self,
        settings: ElasticSettings,
        task: int,
        num_tasks: int,
        name: Callable[[int], str],
        timeout: float,
    ) -> None:
        self.settings, self.me = settings, Member(task, settings.incarnation)
        self._num_tasks, self._name, self._timeout = num_tasks, name, timeout
        self._store = self.connect()
        self._beacons = Beacons(self._store, name, settings.dead_after)
        self.epoch = -1
        self.members: list[Member] = []
        self._lost: str | None = None
        self._join_pending = False
        self.joined = False  # this task joined a running job (it takes the chief's state)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ store
    def connect(self) -> Any:
        """A new connection to the elastic store (authenticated as the rendezvous is), whose
        failed calls raise `PeerUnavailableError` naming the store (`NamedStore`).

        Raises:
            PeerUnavailableError: The store does not answer.
        """
        host, port = self.settings.store
        bound = max(self._timeout, STORE_CALL_SECONDS)
        where = f"{self._name(self.me.task)}'s elastic store at {host}:{port}"
        hint = f"the launcher (`phalanx launch`, torchrun's agent) or {ELASTIC_STORE_ENV}'s host serves it"
        try:
            store = dist.TCPStore(host, port, None, is_master=False, timeout=timedelta(seconds=bound))
        except dist.DistError as exc:
            raise store_unavailable(where, bound, "connect", hint, exc) from exc
        prefix = self.settings.prefix
        return NamedStore(_authenticated(dist.PrefixStore(prefix, store), prefix), where, bound, hint)

    def _wait_for(self, key: str, what: str) -> bytes:
        wait = Wait(self._timeout)
        while not self._store.check([key]):
            if wait.over():
                raise self._gave_up(what)
            time.sleep(0.02)
        return bytes(self._store.get(key))

    def _gave_up(self, what: str, seconds: float | None = None) -> PeerUnavailableError:
        return PeerUnavailableError(
            f"{self._name(self.me.task)} gave up after {seconds or self._timeout:g}s waiting for {what}. "
            "HINT: check the other tasks' logs and that the launcher (which serves the store) runs."
        )

    # ------------------------------------------------------------------ forming (all workers)
    @property
    def num_tasks(self) -> int:
        """How many training tasks the cluster has (members or not)."""
        return self._num_tasks

    @property
    def rank(self) -> int:
        """This task's rank in the current epoch."""
        return self.members.index(self.me)

    @property
    def own_name(self) -> str:
        """This task's name (``worker:2``), for log lines and errors."""
        return self._name(self.me.task)

    def task_name(self, rank: int) -> str:
        """The name of the task with this rank in the current epoch."""
        return self._name(self.members[rank].task) if 0 <= rank < len(self.members) else f"worker:{rank}"

    def start(self) -> None:
        """Joins the job: the first formation (every task of incarnation 0 that comes before it is
        decided), else as a joiner (`joined`).

        Raises:
            PeerUnavailableError: A joiner was not admitted, or the job finished first.
            BelowMinimumWorkersError: Fewer tasks than the minimum form the job.
        """
        self._store.set(f"alive/{self.me.task}", f"{self.me.incarnation}:0")
        self._start_thread()
        try:
            self._enter()
        except BaseException:
            # the watcher must not outlive a failed start: a daemon thread inside a store call
            # when the interpreter finalizes aborts the process (SIGABRT instead of the error)
            self.stop()
            raise

    def _enter(self) -> None:
        if self.me.incarnation == 0 and not self._store.check(["epoch"]):
            # the first formation: every task that checked in, once the others are lost (or
            # after the timeout); no joiner (it takes the chief's state at the first boundary)
            self._store.set(f"e/0/here/{self.me}", "1")
            self._decide_or_wait(0, [Member(t, 0) for t in range(self._num_tasks)], admit=False)
            if self.me in _parse_members(self._store.get("e/0/members")):
                self._adopt(0)
                return
        # a restarted task, or one that came after the first group formed without it
        self.joined = True
        self._store.set(f"join/{self.me.task}", str(self.me.incarnation))
        log.warning("%s asks to join the running job.", self._name(self.me.task))
        wait = Wait(self._timeout)
        while True:
            if self._store.check(["finished"]):
                raise PeerUnavailableError(
                    f"{self._name(self.me.task)} was restarted to join the job, but the job finished first "
                    "(a member closed its strategy). HINT: nothing to do; the job's result is the others'."
                )
            if self._store.check(["epoch"]):
                epoch = int(self._store.get("epoch"))
                if self.me in _parse_members(self._store.get(f"e/{epoch}/members")):
                    self._adopt(epoch)
                    return
            if wait.over():
                raise PeerUnavailableError(
                    f"{self._name(self.me.task)} was not admitted to the running job within "
                    f"{self._timeout:g}s. HINT: the members admit joiners at a step boundary; check their "
                    "logs."
                )
            time.sleep(0.05)

    def reform(self, admit: bool = True) -> None:
        """Moves to the next epoch with every live member and, with ``admit``, the waiting
        joiners (every survivor, after a failure or when `join_pending`; ``admit=False``: the
        first group failed while it formed, and a joiner waits for the first step boundary).

        Raises:
            BelowMinimumWorkersError: Fewer than ``min_workers`` are left.
            PeerUnavailableError: This task was left out (it was taken for lost).
        """
        epoch = self.epoch + 1
        self._store.set(f"e/{epoch}/here/{self.me}", "1")
        self._decide_or_wait(epoch, self.members, admit)
        self._adopt(epoch)

    def _decide_or_wait(self, epoch: int, old: list[Member], admit: bool) -> None:
        """The first to check in decides; if that decider is lost before it publishes, the
        next to notice takes over (numbered attempts: exactly one decider each). The others
        wait a little longer than a decider does (`DECIDE_MARGIN`): it may have started first."""
        wait = Wait(self._timeout + DECIDE_MARGIN)
        attempt = 0
        while True:
            key = f"e/{epoch}/decider/{attempt}"
            if self._store.add(key, 1) == 1:
                self._store.set(f"{key}/task", str(self.me))
                self._decide(epoch, old, admit)
                return
            while not self._store.check([f"e/{epoch}/members"]):
                if self._decider_lost(key):
                    break
                if wait.over():
                    raise self._gave_up(f"the members of epoch {epoch}", self._timeout + DECIDE_MARGIN)
                time.sleep(0.02)
            else:
                return
            attempt += 1

    def _decider_lost(self, key: str) -> bool:
        if not self._store.check([f"{key}/task"]):
            return False
        return self.lost_reason(Member.parse(self._store.get(f"{key}/task").decode())) is not None

    def _decide(self, epoch: int, old: list[Member], admit: bool) -> None:
        wait = Wait(self._timeout)
        while True:
            here = [m for m in old if self._store.check([f"e/{epoch}/here/{m}"])]
            gone = [m for m in old if m not in here and self.lost_reason(m) is not None]
            if len(here) + len(gone) == len(old) or wait.over():
                break
            time.sleep(0.02)
        joiners = self._joiners({m.task for m in here}) if admit else []
        # joiners after the members that stay: rank 0, whose state every member takes, is never
        # a joiner (a restarted task 0 would hand out its fresh weights)
        by_task = lambda m: m.task  # noqa: E731
        self._publish(epoch, sorted(here, key=by_task) + sorted(joiners, key=by_task))

    def _joiners(self, present: set[int]) -> list[Member]:
        joiners = []
        for task in range(self._num_tasks):
            if task in present or not self._store.check([f"join/{task}"]):
                continue
            member = Member(task, int(self._store.get(f"join/{task}")))
            if self.lost_reason(member) is None:
                joiners.append(member)
            self._store.delete_key(f"join/{task}")
        return joiners

    def _publish(self, epoch: int, members: list[Member]) -> None:
        self._store.set(f"e/{epoch}/members", _members_text(members))
        self._store.set("epoch", str(epoch))

    def _log_change(self, epoch: int, members: list[Member]) -> None:
        """The chief (rank 0 of the new epoch) logs who left and who joined, and when (at the
        first formation: who is missing, if any task is)."""
        if members[0] != self.me or (epoch == 0 and len(members) == self._num_tasks):
            return
        if epoch == 0:
            log.warning(
                "Elastic membership epoch 0 at %s: the first group formed with %d workers %s; missing: %s "
                "(lost before the first step, or not checked in within %gs); restarted, they join.",
                time.strftime("%H:%M:%S"),
                len(members),
                [self._name(m.task) for m in members],
                [self._name(t) for t in range(self._num_tasks) if t not in {m.task for m in members}],
                self._timeout,
            )
            return
        log.warning(
            "Elastic membership epoch %d at %s: %d workers %s; left: %s; joined: %s.",
            epoch,
            time.strftime("%H:%M:%S"),
            len(members),
            [self._name(m.task) for m in members],
            [self._name(m.task) for m in self.members if m not in members],
            [self._name(m.task) for m in members if m not in self.members],
        )

    def _adopt(self, epoch: int) -> None:
        members = _parse_members(self._wait_for(f"e/{epoch}/members", f"the members of epoch {epoch}"))
        if self.me not in members:
            raise PeerUnavailableError(
                f"{self._name(self.me.task)} was left out of membership epoch {epoch} (the others took it "
                f"for lost: no beacon for {self.settings.dead_after:g}s). HINT: a restarted task joins again."
            )
        if len(members) < self.settings.min_workers:
            missing = [self._name(t) for t in range(self._num_tasks) if t not in {m.task for m in members}]
            raise BelowMinimumWorkersError(
                f"Only {len(members)} workers are left ({[self._name(m.task) for m in members]}), fewer than "
                f"the job's minimum of {self.settings.min_workers} ({MIN_WORKERS_ENV}); missing: {missing}. "
                "HINT: restart the job; BackupAndRestore or a PreemptionCheckpointHandler resumes it."
            )
        if self.members or epoch == 0:
            self._log_change(epoch, members)
        self.epoch, self.members, self._lost, self._join_pending = epoch, members, None, False

    # ------------------------------------------------------------------ watching
    def lost_reason(self, member: Member) -> str | None:
        """Why ``member`` counts as lost, or None while its beacon moves (this thread's view)."""
        return self._beacons.lost_reason(member)

    def failure(self) -> str | None:
        """A member of the current epoch that is lost (the group's extra failure), or None."""
        return self._lost

    @property
    def join_pending(self) -> bool:
        """Whether a task waits to join (seen by this worker's watcher)."""
        return self._join_pending

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="phalanx-membership", daemon=True)
        self._thread.start()
        # stopped before the interpreter finalizes, however the program ends (an error, a
        # sys.exit): a daemon thread inside a store call then would abort the process
        atexit.register(self.stop)

    def _watch(self) -> None:
        beacons = Beacons(self.connect(), self._name, self.settings.dead_after)  # its own connection
        count = 0
        while not self._stop.wait(BEACON_SECONDS):
            count += 1
            try:
                beacons.store.set(f"alive/{self.me.task}", f"{self.me.incarnation}:{count}")
                members = self.members
                lost = next((r for m in members if m != self.me and (r := beacons.lost_reason(m))), None)
                if lost is not None and members is self.members:  # not a re-form's new members
                    self._lost = self._lost or lost
                present = {m.task for m in members}
                self._join_pending = any(
                    beacons.store.check([f"join/{t}"]) for t in range(self._num_tasks) if t not in present
                )
            except Exception as exc:  # the store is gone: the launcher ended
                log.warning("The elastic membership watcher stopped: %s", exc)
                return

    def stop(self, finished: bool = False) -> None:
        """Stops the beacon (this worker leaves; call at the end). ``finished``: the job is
        done (a member closed its strategy): a task still waiting to join is told so."""
        if finished:
            try:
                self._store.set("finished", "1")
            except Exception as exc:  # the launcher ended: nobody waits to join any more
                log.debug("Could not record that the job finished: %s", exc)
        atexit.unregister(self.stop)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_SECONDS)
