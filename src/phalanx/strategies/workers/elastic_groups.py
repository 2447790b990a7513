"""The groups of an elastic MultiWorkerMirroredStrategy: one per membership epoch
(`phalanx.communication.membership.membership`), made (`make_group`), dropped and re-made (`reform`), and
dropped so that nothing of theirs is still in flight (`drop_group`,
`phalanx.communication.transports.gloo.sockets`). Functions of the strategy (its private state), kept
apart from the strategy's other concerns."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.group.worker_group import ElasticGroup, WorkerGroup
from phalanx.communication.transports.gloo.sockets import GroupSockets
from phalanx.strategies.workers.bucket_sync import BucketSync, group_buckets

__all__ = ["REFORM_ATTEMPTS", "REFORM_JOIN_TIMEOUT", "close_elastic", "drop_group", "make_group", "reform"]

log = logging.getLogger("phalanx")

REFORM_JOIN_TIMEOUT = 30.0  # seconds the members of a re-formed group wait for each other
REFORM_ATTEMPTS = 5  # new groups that fail while forming (a member lost meanwhile) before giving up
IN_FLIGHT_WAIT = 2.0  # seconds a dropped group's shut-down collectives get to fail (milliseconds, measured)


def make_group(strategy: Any, admit: bool = False) -> WorkerGroup:
    """The group of the membership's current epoch (an elastic job; all its members), its
    connections recorded (`GroupSockets`).

    A member lost while the group forms (its check-in stops at the membership's verdict) makes
    the members re-form without it and try again, `REFORM_ATTEMPTS` groups in all: the first
    group as a re-formed one. ``admit``: whether those re-forms admit waiting joiners (not
    while the first group forms: a joiner takes the chief's state at the first step boundary).

    Raises:
        BelowMinimumWorkersError: Fewer workers are left than the job's minimum.
        PeerUnavailableError: The group failed `REFORM_ATTEMPTS` times, or this worker was left out.
    """
    membership = strategy._membership
    assert membership is not None
    attempt = 1
    while True:
        try:
            return _group_of_epoch(strategy)
        except PeerUnavailableError as exc:  # a member was lost while the group formed: once more
            if attempt >= REFORM_ATTEMPTS:
                raise
            epoch, reason = membership.epoch, str(exc).split(". HINT")[0]
            log.warning("Membership epoch %d's group did not form (%s); re-forming.", epoch, reason)
        attempt += 1
        membership.reform(admit)


def _group_of_epoch(strategy: Any) -> WorkerGroup:
    membership = strategy._membership
    strategy._num_workers, strategy._worker_index = len(membership.members), membership.rank
    join = strategy._group_settings[0]
    if membership.epoch > 0:  # every member is alive and waiting: a lost one must not cost 120 s
        join = min(join, REFORM_JOIN_TIMEOUT)
    host, port = membership.settings.store
    elastic = ElasticGroup(f"phalanx/elastic/g{membership.epoch}/", membership.failure)
    sockets = GroupSockets(membership.settings.store)
    group: WorkerGroup = sockets.record(
        lambda: strategy._new_group(
            host, port, membership.rank, len(membership.members), membership.task_name, join, elastic
        )
    )
    strategy._group_sockets = sockets
    return group


def drop_group(strategy: Any) -> None:
    """Drops the current group without waiting for any peer. After a failure (a member lost:
    a collective may have been cut short) it first shuts down the group's connections, so that
    what is in flight on them fails now, here and on the peers (see
    `phalanx.communication.transports.gloo.sockets`). A healthy group (every member re-forms to admit a
    joiner, after a collective every member completed) is left to close its connections
    itself: shut down at once, a peer could lose the last bytes of that collective (a reset
    discards what it has not read yet) and take another path than the members."""
    group: WorkerGroup | None = strategy._group
    sockets: GroupSockets | None = strategy._group_sockets
    strategy._group_sockets = None
    cut_short = group is None or group.failure is not None
    if sockets is not None and cut_short:
        sockets.shut_down()
    if group is None:
        return
    group.abandon()
    if cut_short:
        _let_in_flight_fail(group)


def _let_in_flight_fail(group: WorkerGroup) -> None:
    """Waits (bounded) until the group's collectives cut off by the shutdown have failed, so
    that their completion callbacks run now, not while the interpreter finalizes."""
    deadline = time.monotonic() + IN_FLIGHT_WAIT
    while group.in_flight() and time.monotonic() < deadline:
        time.sleep(0.005)


def reform(strategy: Any, admit: bool = True) -> None:
    """`MultiWorkerMirroredStrategy.reform` (see there)."""
    membership = strategy._membership
    if membership is None:
        raise RuntimeError(
            f"{strategy!r} is not elastic. HINT: set PHALANX_MIN_WORKERS (phalanx launch --min-workers)."
        )
    if strategy._buckets is not None:
        strategy._buckets.release()
    drop_group(strategy)
    plain = strategy._plain.values()
    params = [p for p in (ref() for ref in plain) if isinstance(p, torch.nn.Parameter)]
    for param in params:  # a step cut short left partial sums in .grad: drop them
        param.grad = None
    membership.reform(admit)
    strategy._group = make_group(strategy, admit)
    if strategy._num_local_replicas == 1:
        strategy._buckets = group_buckets(strategy, strategy._group)
        for param in params:  # in creation order, as on every member
            strategy._buckets.add(param)
        strategy._bucket_sync = BucketSync(strategy._gradient_sync, strategy._buckets, strategy)


def close_elastic(strategy: Any) -> None:
    """After the group closed: if a member was lost at the end (close() then leaves the group
    as it is), ends what is still in flight on its connections while the interpreter runs;
    then stops the beacon and records that the job finished."""
    group, sockets = strategy._group, strategy._group_sockets
    strategy._group_sockets = None
    failed = group is not None and group.failure is not None  # then close() did not tear it down
    if sockets is not None and failed and sockets.shut_down():
        _let_in_flight_fail(group)
    strategy._membership.stop(finished=True)
