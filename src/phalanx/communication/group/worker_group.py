"""Cross-process collectives with deadlines and a health check (the transport of MultiWorkerMirroredStrategy).

`WorkerGroup` wraps one torch.distributed process group of the training tasks (rank =
worker index, world = number of workers). Every worker creates it, and then calls the same
collectives in the same order ("all workers"); nothing here is called by one worker alone.

Bounds (defaults; each also has an environment variable, read when a group is made):

* **Joining** waits at most ``join_timeout`` (120 s, ``PHALANX_JOIN_TIMEOUT_SECONDS``) for
  every task to check in at the chief's TCPStore, logging on ``logging.getLogger("phalanx")``
  every 5 s (a third of shorter deadlines) which tasks it still waits for, then raises
  `PeerUnavailableError` naming them.
* **A worker that dies** (crash, SIGKILL, machine lost): the collective that waits for it
  fails as soon as gloo sees its sockets close (at once after a SIGKILL); with two workers
  the error names the other one at once, with more it names the task whose heartbeat
  stopped, within the heartbeat bound below.
* **A worker that stops answering** (hung, stopped, cut off): every worker adds to its
  heartbeat counter in the chief's store every `HEARTBEAT_INTERVAL` (1 s) and reads the
  others'; a counter that has not moved for ``heartbeat_timeout`` (10 s,
  ``PHALANX_HEARTBEAT_TIMEOUT_SECONDS``) marks that task dead. Waiting collectives look at
  the health check every `POLL_SECONDS` (0.5 s), so the error comes within
  heartbeat_timeout + 1 s + 0.5 s (about 11.5 s < 12 s by default).
* **A network partition**: the chief's side names the workers cut off (their heartbeats
  stopped); a worker cut off from the chief's store cannot finish a heartbeat round (store
  calls block, they do not fail) and names the chief once no round finished for
  ``heartbeat_timeout``. Closing after a failure never waits on the store or on a peer, so
  the process exits (docs/multi_machine.md).
* **Any collective** fails after ``collective_timeout`` (the strategy's timeout, or
  ``CommunicationOptions.timeout_seconds`` per call). The process group is created with the
  same timeout, so gloo's own deadline can cap a longer per-call timeout.

Addresses: the chief's store listens on the chief's address only, and gloo binds the
interface that holds this task's address (`phalanx.communication.transports.interfaces`).

Every error is a `PeerUnavailableError` naming the missing task(s) and is sticky: after a
failure, every later collective of the group raises at once (restart the job).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx.communication.checks.collective_check import CollectiveCheck, check_enabled
from phalanx.communication.checks.collective_watch import CollectiveWatch
from phalanx.communication.checks.health import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HealthCheck,
    PeerUnavailableError,
    seconds_from_env,
)
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError, StallSettings
from phalanx.communication.group.collectives import GroupCollectives
from phalanx.communication.group.failures import POLL_SECONDS, GroupFailures
from phalanx.communication.group.process_group import BACKEND, PhalanxProcessGroup, register_backend
from phalanx.communication.group.recent_works import SUBGROUP_KEEP_WORKS_COUNT, RecentWorks
from phalanx.communication.group.subgroups import SubgroupEngine
from phalanx.communication.group.transports import open_transport, point_to_point_of, subgroup_transport
from phalanx.communication.membership.borrowed_store import (
    borrowed_prefix,
    borrowed_store,
    claim_default_group,
)
from phalanx.communication.membership.leaving import LEAVE_TIMEOUT, leave_together
from phalanx.communication.membership.rendezvous import JOIN_TIMEOUT_ENV, Rendezvous
from phalanx.communication.transports.choice import check_settings
from phalanx.communication.transports.gloo.transport import GlooTransport
from phalanx.communication.transports.interfaces import bind_gloo_to, strip_brackets

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_JOIN_TIMEOUT",
    "ElasticGroup",
    "HEARTBEAT_INTERVAL",
    "JOIN_TIMEOUT_ENV",
    "POLL_SECONDS",
    "HealthCheck",
    "PeerUnavailableError",
    "WorkerGroup",
    "seconds_from_env",
]

DEFAULT_JOIN_TIMEOUT = 120.0
HEARTBEAT_TIMEOUT_ENV = "PHALANX_HEARTBEAT_TIMEOUT_SECONDS"


@dataclasses.dataclass(frozen=True)
class ElasticGroup:
    """What a group of an elastic job (`phalanx.communication.membership.membership`) adds: its store keys'
    prefix (one per membership epoch, on a store that outlives the workers) and the membership's
    verdict on lost members (a failure of the group, like a stopped heartbeat)."""

    prefix: str
    lost: Callable[[], str | None]


class WorkerGroup(GroupFailures, GroupCollectives):
    """The process group of the training tasks, with check-in, heartbeats and deadlines.

    Made by every worker at the same time (all workers): connects to the chief's TCPStore
    (hosted by rank 0 at ``host:port``, or torchrun's agent store, or the store of a
    torch.distributed group initialised before, e.g. by Ray Train: `borrowed_store`), checks in
    and waits for every task, then initialises the process group (or reuses an initialised one of the same
    rank and size) and starts the health check. See the module docstring for the bounds.

    Args:
        host, port: The chief's address, where the rendezvous store listens (the chief
            listens on that address only).
        rank, world_size: This worker (0 = chief) and the number of workers.
        backend: "gloo" or "nccl".
        task_name: ``task_name(rank) -> "worker:1 (host:port)"``, for messages.
        join_timeout: Seconds to wait for every task to check in.
        collective_timeout: Default deadline of each collective, in seconds.
        heartbeat_timeout: Seconds without a heartbeat before a task counts as dead.
        own_host: This task's host in the cluster spec: gloo binds the interface that holds
            it (`bind_gloo_to`), unless ``GLOO_SOCKET_IFNAME`` is set. None: gloo's default.
        stall: The stall inspector's settings (default: `StallSettings.from_env`): every
            collective is signed, and workers that wait in collectives that cannot meet raise
            `CollectiveMismatchError` (`phalanx.communication.checks.stall_inspector`).
        elastic: An elastic job's group (`ElasticGroup`); None: the job's only group.

    Raises:
        PeerUnavailableError: A task did not join within ``join_timeout`` (it is named).
        ValueError: The address cannot be served, an existing process group has another rank or
            size or is not on a TCPStore, or an elastic job finds one initialised already.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        task_name: Callable[[int], str],
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        collective_timeout: float = 600.0,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        own_host: str | None = None,
        stall: StallSettings | None = None,
        elastic: ElasticGroup | None = None,
    ) -> None:
        if backend == "gloo":
            check_settings()  # before anything is opened
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self._name = task_name
        self._host, self._port = strip_brackets(host), port
        self._collective_timeout = collective_timeout
        self._failure: str | None = None
        self._closed = False
        self._elastic = elastic
        self._subgroup_checks: list[CollectiveCheck] = []
        # each new_group()'s own recent works: a few, as its gloo runs few (`RecentWorks`)
        self._subgroup_works: list[RecentWorks] = []
        # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT; restarts reuse it.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        prefix = f"phalanx/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') if agent_store else '0'}/"
        borrowed = borrowed_store()
        if elastic is not None and borrowed is not None:
            raise ValueError(
                "An elastic job (PHALANX_MIN_WORKERS) re-forms its process group, which it cannot do with "
                "a torch.distributed group that something else initialised (Ray Train, your own "
                "init_process_group). Received: an initialised group of rank "
                f"{dist.get_rank()} of {dist.get_world_size()}. HINT: let the harness restart the job "
                "instead (Ray's FailureConfig, torchrun --max-restarts) with BackupAndRestore, or unset "
                "PHALANX_MIN_WORKERS (docs/clusters.md)."
            )
        if elastic is not None:  # a store that outlives every worker, fresh keys per membership epoch
            agent_store, prefix = True, elastic.prefix
        elif borrowed is not None:  # Ray Train's (or the user's) group and store
            (host, port), agent_store, prefix = borrowed, True, borrowed_prefix()
            self._host, self._port = strip_brackets(host), port
        rendezvous = Rendezvous(self._host, port, rank, world_size, task_name, prefix, agent_store)
        deadline = time.monotonic() + join_timeout
        self._store = rendezvous.open(deadline, join_timeout)
        self._watch = CollectiveWatch(rank, world_size, task_name, stall or StallSettings.from_env())
        if self._watch.enabled:
            self._watch.publish_initial(self._store)  # before check-in: every key exists after it
        self._store.set(f"collective-check/{rank}", "1" if check_enabled() else "0")
        rendezvous.check_in(self._store, deadline, join_timeout, lambda: self._lost)  # elastic: its verdict
        # the codes are on when every worker has them on (a first message must match its peer's)
        checked = all(
            v == b"1" for v in self._store.multi_get([f"collective-check/{r}" for r in range(world_size)])
        )
        self._check = CollectiveCheck(rank, world_size, task_name, checked, self._watch.inspector.peer_state)
        self._check.attach_store(self._store)
        self._works = RecentWorks()
        if backend == "gloo":
            bind_gloo_to(own_host)
        self._health = HealthCheck(
            # its own connection, whose operations time out with the heartbeat: a chief that
            # stops answering is reported within the same bound as any other task
            lambda: rendezvous.open(time.monotonic() + heartbeat_timeout, heartbeat_timeout, heartbeat=True),
            rank,
            world_size,
            task_name,
            timeout=heartbeat_timeout,
            gossip=self._watch.inspector if self._watch.enabled else None,
        )
        self._health.start()
        transport = None
        if backend == "gloo":  # before the process group: a TLS job registers no plaintext gloo in it
            try:
                transport = open_transport(
                    self._store,
                    rank,
                    world_size,
                    (self._host, port),
                    own_host,
                    task_name,
                    lambda: self.failure,
                    collective_timeout,
                    join_timeout,
                    self._works.add,
                    self._check.mismatch,
                )
            except PeerUnavailableError as exc:  # close what this group opened, then say why
                self._failure, self._closed = str(exc), True
                self._health.stop()
                raise
        self._transport = transport
        # "world": this object initialised torch.distributed; "subgroup": it made a group of
        # another backend in the user's; "borrowed": it uses the user's default group.
        # ``_pg``: the group torch sees; ``_group``: the one under it that carries what our own
        # transports do not (the phalanx group's gloo, or the user's group).
        self._pg, self._ownership = self._init_group(backend)
        self._group: Any = self._pg.gloo if isinstance(self._pg, PhalanxProcessGroup) else self._pg
        self._gloo = GlooTransport(
            self._group,
            rank,
            world_size,
            self._check.mismatch,
            self._works.add,
            checked and backend == "gloo",
            self.wait,
        )
        atexit.register(self._at_exit)

    def _init_group(self, backend: str) -> tuple[Any, str]:
        timeout = timedelta(seconds=self._collective_timeout)
        ours = BACKEND if backend == "gloo" else backend  # CPU jobs: phalanx's own backend
        if ours == BACKEND:
            register_backend()
        if not dist.is_initialized():
            dist.init_process_group(
                ours,
                store=dist.PrefixStore("pg", self._store),
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
                pg_options=self if ours == BACKEND else None,
            )
            claim_default_group()  # ours: the preemption board must not take it for a borrowed one
            return dist.group.WORLD, "world"
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise ValueError(
                "torch.distributed is already initialised with another rank or size than this "
                f"cluster's. Received: rank {dist.get_rank()} of {dist.get_world_size()}, cluster: "
                f"rank {self.rank} of {self.world_size}. HINT: let the strategy initialise "
                "torch.distributed, or initialise it with the cluster's rank and world size."
            )
        if dist.get_backend() == backend:
            return dist.group.WORLD, "borrowed"
        return dist.new_group(
            backend=ours, timeout=timeout, pg_options=self if ours == BACKEND else None
        ), "subgroup"

    @property
    def _lost(self) -> str | None:
        return self._elastic.lost() if self._elastic is not None else None

    def in_flight(self) -> list[Any]:
        """This group's collectives that were started and have not completed yet (those its
        `RecentWorks` holds): what dropping the group must let fail before it goes on."""
        return [*self._works.pending(), *(w for works in self._subgroup_works for w in works.pending())]

    @property
    def uses_tls(self) -> bool:
        """Whether collectives that shared memory does not carry go over the TLS ring
        (`phalanx.communication.transports.tls.ring`) instead of gloo."""
        return self.transport_name == "tls"

    @property
    def uses_shared_memory(self) -> bool:
        """Whether CPU all-reduces go through shared memory (every worker on this machine)."""
        return self.transport_name == "shm"

    @property
    def transport_name(self) -> str:
        """The name of the transport that carries this group's collectives: a registered one's
        (`phalanx.communication.transports.registry`: "shm", "tls", ...), else "gloo"."""
        return self._transport.name if self._transport is not None else "gloo"

    @property
    def point_to_point(self) -> Any:
        """What carries ``send``/``recv`` besides the process group's gloo: the TLS
        transport's links between any two workers (`TlsPeers`), else None."""
        return point_to_point_of(self._transport)

    def subgroup(
        self,
        gloo: Any,
        store: Any,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        timeout: float | None = None,
        group_name: str = "",
    ) -> SubgroupEngine:
        """The engine of a group of this job's workers made with ``torch.distributed.new_group()``
        (its members, at once; `phalanx.communication.group.subgroups`): signed as this group's
        collectives are, and a mismatch on it fails this group too. Under TLS its collectives
        go over a ring of its members (opened here), elsewhere over ``gloo``.

        Args:
            gloo: The gloo group between the members.
            store: The new group's store.
            rank, size: This worker's rank in the new group and its size.
            global_ranks: Each member's rank in the job (empty: every worker).
            timeout: The group's own deadline for a wait, in seconds: kept where it is shorter
                than this group's collective timeout (torch's default for a new group, 30 min,
                never lengthens this group's); None: this group's.
            group_name: torch's name of the group.

        Raises:
            PeerUnavailableError: Under TLS, a member did not join the group's ring in time.
        """
        members = list(global_ranks) or list(range(size))
        names = [self._name(r) for r in members]
        shorter = timeout if timeout is not None and timeout < self._collective_timeout else None
        works = RecentWorks(keep_count=SUBGROUP_KEEP_WORKS_COUNT)
        self._subgroup_works.append(works)
        engine = SubgroupEngine(
            gloo,
            store,
            rank,
            size,
            names,
            self._check.enabled,
            works.add,
            self._check_usable,
            self.wait,
            self._watch if size == self.world_size else None,  # the same numbering everywhere
            lambda mismatch: subgroup_transport(
                self._transport, store, rank, size, names.__getitem__, group_name, mismatch
            ),
            shorter,
            self.point_to_point,
        )
        self._subgroup_checks.append(engine.check)
        return engine

    # ---------------------------------------------------------------- shutdown
    def _at_exit(self) -> None:
        try:
            self.close()
        except CollectiveMismatchError as exc:
            # An exception in an atexit hook does not change the exit status, and a worker whose
            # peers failed on a mismatch must not report success: say why, and exit with 1.
            print(f"phalanx: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)

    def close(self) -> None:
        """Announces that this worker leaves, waits (up to 10 s) until every healthy worker
        did, stops the heartbeat and tears down the process groups this object created
        (all workers, at the end of the program; also run at interpreter exit).

        Raises:
            CollectiveMismatchError: Peers wait in a collective this worker never issued (it
                ran on or stopped early): the stall inspector's verdict, as on every worker.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self._watch.begin_closing()
        raised = self._failure is not None  # this worker already raised its error
        transport = self._transport
        if transport is not None and transport.closes_before_leaving:
            transport.close()
        if self.failure is None:
            self._leave()
        if transport is not None and not transport.closes_before_leaving:
            transport.close()  # after leaving: a peer may still read this worker's last bytes
        self._gloo.close(timeout=0.5 if self.failure else 5.0)
        self._health.stop()
        # A peer seen waiting in a collective this closing worker never issued is a mismatch
        # even before the bound: the peer may have raised and exited (taking the store) first.
        mismatch = self._watch.verdict or self._watch.suspicion()
        if mismatch is not None and not raised:
            raise CollectiveMismatchError(mismatch)
        if self.failure is None:  # a collective stuck on a hung peer would block the teardown
            self._tear_down()

    def abandon(self) -> None:
        """Drops this group without waiting for any peer (an elastic job re-forming after a
        loss, or to admit a joiner): closes its transports, stops its heartbeat and destroys
        the torch process group it made, so that the next membership epoch can make its own.
        Collectives of this group raise afterwards."""
        if self._closed:
            return
        self._failure = self._failure or self.failure or "the elastic membership moved on"
        self._closed = True
        atexit.unregister(self._at_exit)
        self._watch.begin_closing()
        if self._transport is not None:
            self._transport.close()
        if self._ownership != "borrowed":  # close its connections: whatever waits on them fails now
            with contextlib.suppress(Exception):
                self._group.abort()
        self._gloo.close(timeout=0.5)
        self._health.stop()
        with contextlib.suppress(Exception):  # a peer's exit broke the group already
            if self._ownership == "world":
                dist.destroy_process_group()
            elif self._ownership == "subgroup":
                dist.destroy_process_group(self._pg)

    def _leave(self) -> None:
        """Announces that this worker leaves and waits for the others (`leave_together`)."""
        leave_together(
            self._store,
            self.rank,
            self.world_size,
            lambda: self.failure,
            self._leave_timeout(),
            self._watch.inspector.someone_waits,
            self._health.timeout,
        )

    def _leave_timeout(self) -> float:
        """How long closing waits for the others: longer while one of them waits in a
        collective, for the stall inspector to name the mismatch on every worker."""
        if not self._watch.enabled:
            return LEAVE_TIMEOUT
        return max(LEAVE_TIMEOUT, self._watch.settings.timeout + 2 * HEARTBEAT_INTERVAL + POLL_SECONDS)

    def _tear_down(self) -> None:
        """Destroys the groups this object created, dropping the last references so that
        their threads are joined now, while every recent work is still held (see
        `RecentWorks`); then lets the works go."""
        with contextlib.suppress(Exception):  # a peer's exit may have broken a group already
            if self._ownership == "world":
                dist.destroy_process_group()
            elif self._ownership == "subgroup":
                dist.destroy_process_group(self._pg)
        if self._transport is not None:
            self._transport.release()
        if self._ownership != "borrowed":
            self._pg = self._group = None
            self._gloo.group = None  # its last reference to the gloo group
            self._works.clear()  # else the user's group may still run: hold them to the end
            for works in self._subgroup_works:  # their groups went with the job's (torch's registry)
                works.clear()
