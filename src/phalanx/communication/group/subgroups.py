"""Groups a user makes with ``torch.distributed.new_group()`` inside a MultiWorkerMirrored program.

Under MultiWorkerMirroredStrategy on CPUs the default process group is phalanx's
(`phalanx.communication.group.process_group`), so ``new_group()`` without ``backend=`` asks the
``"phalanx"`` backend for the new group. It gets a `PhalanxProcessGroup` whose engine is a
`SubgroupEngine`: its collectives are signed and verified as the default group's are
(`phalanx.communication.checks.collective_check`, over
`phalanx.communication.transports.gloo.transport`), with a numbering of their own (a group of some
of the workers makes collectives the others do not), and waited on with the job's deadline and
health check (`WorkerGroup.wait`). So a collective that one member makes and another does not
meets that member's next collective on the group, and the first whose signatures differ raises
`CollectiveMismatchError` on every member, naming each side, before any result of it is used; the
job's group fails with it (sticky), as after a mismatch on the default group.

A group of every worker (``new_group()`` without ``ranks=``) is also watched by the job's
stall inspector: a collective one worker makes on it while the others make none there (they
wait in the job's next collective) is named on every worker within the stall bound, as on the
default group. A group of some of the workers is not (its members count collectives the
others do not make, so the inspector's numbering would differ between workers): such a stall
is named by the job's deadline, or the group's own (``new_group(timeout=...)``).

What carries a subgroup's collectives: under TLS a ring of its members of its own
(`phalanx.communication.transports.tls.opener.TlsTransport.subgroup`), so nothing leaves a
machine in plaintext; elsewhere the gloo group between its members (no shared memory).
``new_group(backend="gloo")`` is torch's own ``ProcessGroupGloo``: phalanx does not replace
torch's gloo backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx.communication.checks.collective_check import CollectiveCheck, Signed
from phalanx.communication.checks.collective_watch import CollectiveWatch
from phalanx.communication.checks.stall_inspector import StallSettings
from phalanx.communication.group.collectives import GroupCollectives
from phalanx.communication.transports.base import Transport
from phalanx.communication.transports.gloo.transport import GlooTransport

__all__ = ["SubgroupEngine"]


class SubgroupEngine(GroupCollectives):
    """The engine of a ``new_group()`` of the job (see the module doc; all its members).

    Made by `WorkerGroup.subgroup`, which passes its own deadline, health and failure state.

    Args:
        gloo: The gloo group between the members, which carries the collectives.
        store: The new group's store (torch prefixes it per group): its mismatch reports.
        rank, size: This worker's rank in the group and the group's size.
        names: Each member's task name (``"worker:1 (host:port)"``), in the group's rank order.
        checked: Whether the job's collectives are signed (every worker agreed).
        keep: Holds gloo's works until the job's group is torn down (`RecentWorks.add`).
        usable: ``usable(what)`` raises once the job's group is closed or failed.
        wait: ``wait(work, what, timeout)``: the job's watched wait (`WorkerGroup.wait`).
        watch: The job's stall-inspector watch, for a group of every worker; None: not watched.
        transport: ``transport(mismatch)``: opens what carries the group's collectives besides
            its gloo (all members at once; the TLS ring of its members), given the group's
            mismatch error; None, or it returns None: gloo carries them.
        timeout: The group's own deadline for a wait, in seconds (shorter than the job's),
            where ``transport`` carries its collectives (gloo enforces its group's timeout
            itself); None: the job's.
        point_to_point: What carries the group's ``send``/``recv`` besides its gloo (the job's
            TLS links), or None.
    """

    def __init__(
        self,
        gloo: Any,
        store: Any,
        rank: int,
        size: int,
        names: Sequence[str],
        checked: bool,
        keep: Callable[[Any], Any],
        usable: Callable[[str], None],
        wait: Callable[[Any, str, float | None], None],
        watch: CollectiveWatch | None = None,
        transport: Callable[[Any], Transport | None] | None = None,
        timeout: float | None = None,
        point_to_point: Any = None,
    ) -> None:
        self.rank, self.world_size = rank, size
        self._usable, self._wait = usable, wait
        name: Callable[[int], str] = lambda r: names[r]  # noqa: E731
        self.point_to_point = point_to_point
        self._watch = watch or CollectiveWatch(rank, size, name, StallSettings(enabled=False))
        self.check = CollectiveCheck(rank, size, name, checked)  # its own numbering
        self.check.attach_store(store)
        self._check = self.check
        self._transport = None if transport is None else transport(self.check.mismatch)
        self._timeout = None if self._transport is None else timeout
        self._gloo = GlooTransport(gloo, rank, size, self.check.mismatch, keep, checked, self.wait)

    def _sign(self, kind: str, tensor: torch.Tensor, what: str) -> tuple[Any, Signed]:
        """The job's stall-inspector signature (job-wide numbering), and this group's code and
        report signature (this group's numbering, which every member shares)."""
        return self._watch.issue(kind, (tensor,), what), self._check.sign(kind, tensor, what)

    @property
    def uses_tls(self) -> bool:
        """Whether the group's collectives go over a TLS ring of its members."""
        return self._transport is not None and self._transport.name == "tls"

    def _check_usable(self, what: str) -> None:
        self._usable(what)

    def _watched_wait(self, work: Any, what: str, timeout: float | None, where_issued: bool) -> None:
        self.wait(work, what, timeout)

    def wait(self, work: Any, what: str, timeout: float | None = None) -> None:
        """Waits with the group's deadline (else the job's) and the job's health check (a
        mismatch fails the job's group)."""
        if timeout is None and self._timeout is not None:  # its errors say which deadline ran out
            what, timeout = f"{what} on a group with a timeout of {self._timeout:g}s", self._timeout
        self._wait(work, what, timeout)
