"""The groups of an elastic MultiWorkerMirroredStrategy: one per membership epoch
(`phalanx.communication.membership.membership`), made, dropped and re-made by `ElasticGroups`,
which owns the membership, the current group and that group's connections
(`phalanx.communication.transports.gloo.sockets`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.group.worker_group import ElasticGroup, WorkerGroup
from phalanx.communication.membership.membership import Membership
from phalanx.communication.transports.gloo.sockets import GroupSockets

__all__ = ["REFORM_ATTEMPTS", "REFORM_JOIN_TIMEOUT", "ElasticGroups", "NewGroup"]

log = logging.getLogger("phalanx")

REFORM_JOIN_TIMEOUT = 30.0  # seconds the members of a re-formed group wait for each other
REFORM_ATTEMPTS = 5  # new groups that fail while forming (a member lost meanwhile) before giving up
IN_FLIGHT_WAIT = 2.0  # seconds a dropped group's shut-down collectives get to fail (milliseconds, measured)

NewGroup = Callable[[str, int, int, int, Callable[[int], str], float, ElasticGroup], WorkerGroup]
"""``new_group(host, port, rank, world, task_name, join_timeout, elastic)``: the strategy's
`WorkerGroup` of one membership epoch."""


class ElasticGroups:
    """The groups of an elastic job, one per membership epoch (every member calls the same
    methods at the same points).

    Args:
        membership: The job's membership (started by the caller).
        new_group: Makes the group of an epoch (`NewGroup`).
        join_timeout: How long the members of the first group wait for each other.
    """

    def __init__(self, membership: Membership, new_group: NewGroup, join_timeout: float) -> None:
        self.membership = membership
        self._new_group, self._join_timeout = new_group, join_timeout
        self._sockets: GroupSockets | None = None
        self.group: WorkerGroup | None = None

    @property
    def rank(self) -> int:
        """This worker's rank in the current epoch."""
        return self.membership.rank

    @property
    def size(self) -> int:
        """The number of members of the current epoch."""
        return len(self.membership.members)

    def make(self, admit: bool = False) -> WorkerGroup:
        """The group of the membership's current epoch (all its members), its connections
        recorded (`GroupSockets`).

        A member lost while the group forms (its check-in stops at the membership's verdict)
        makes the members re-form without it and try again, `REFORM_ATTEMPTS` groups in all:
        the first group as a re-formed one. ``admit``: whether those re-forms admit waiting
        joiners (not while the first group forms: a joiner takes the chief's state at the first
        step boundary).

        Raises:
            BelowMinimumWorkersError: Fewer workers are left than the job's minimum.
            PeerUnavailableError: The group failed `REFORM_ATTEMPTS` times, or this worker was
                left out.
        """
        attempt = 1
        while True:
            try:
                self.group = self._group_of_epoch()
                return self.group
            except PeerUnavailableError as exc:  # a member was lost while the group formed: once more
                if attempt >= REFORM_ATTEMPTS:
                    raise
                epoch, reason = self.membership.epoch, str(exc).split(". HINT")[0]
                log.warning("Membership epoch %d's group did not form (%s); re-forming.", epoch, reason)
            attempt += 1
            self.membership.reform(admit)

    def _group_of_epoch(self) -> WorkerGroup:
        membership = self.membership
        join = self._join_timeout
        if membership.epoch > 0:  # every member is alive and waiting: a lost one must not cost 120 s
            join = min(join, REFORM_JOIN_TIMEOUT)
        host, port = membership.settings.store
        elastic = ElasticGroup(f"{membership.settings.prefix}g{membership.epoch}/", membership.failure)
        sockets = GroupSockets(membership.settings.store)
        group: WorkerGroup = sockets.record(
            lambda: self._new_group(
                host, port, membership.rank, len(membership.members), membership.task_name, join, elastic
            )
        )
        self._sockets = sockets
        return group

    def reform(self, admit: bool = True) -> WorkerGroup:
        """Drops the current group and makes the next epoch's (see
        `MultiWorkerMirroredStrategy.reform`)."""
        self.drop()
        self.membership.reform(admit)
        return self.make(admit)

    def drop(self) -> None:
        """Drops the current group without waiting for any peer. After a failure (a member
        lost: a collective may have been cut short) it first shuts down the group's
        connections, so that what is in flight on them fails now, here and on the peers (see
        `phalanx.communication.transports.gloo.sockets`). A healthy group (every member
        re-forms to admit a joiner, after a collective every member completed) is left to
        close its connections itself: shut down at once, a peer could lose the last bytes of
        that collective (a reset discards what it has not read yet) and take another path."""
        group, sockets = self.group, self._sockets
        self.group, self._sockets = None, None
        cut_short = group is None or group.failure is not None
        if sockets is not None and cut_short:
            sockets.shut_down()
        if group is None:
            return
        group.abandon()
        if cut_short:
            _let_in_flight_fail(group)

    def close(self) -> None:
        """After the group closed: if a member was lost at the end (close() then leaves the
        group as it is), ends what is still in flight on its connections while the interpreter
        runs; then stops the beacon and records that the job finished."""
        group, sockets = self.group, self._sockets
        self._sockets = None
        failed = group is not None and group.failure is not None  # then close() did not tear it down
        if group is not None and sockets is not None and failed and sockets.shut_down():
            _let_in_flight_fail(group)
        self.membership.stop(finished=True)


def _let_in_flight_fail(group: WorkerGroup) -> None:
    """Waits (bounded) until the group's collectives cut off by the shutdown have failed, so
    that their completion callbacks run now, not while the interpreter finalizes."""
    deadline = time.monotonic() + IN_FLIGHT_WAIT
    while group.in_flight() and time.monotonic() < deadline:
        time.sleep(0.005)
