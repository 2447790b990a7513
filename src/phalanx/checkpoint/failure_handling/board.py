"""Messages between the workers' preemption handlers: errors, notices and exits, by task name.

A job of several workers posts them in the MultiWorkerMirrored rendezvous store (the chief's
TCPStore, whose values carry a MAC of the cluster token: `phalanx.communication.membership.rendezvous`), on
two connections of its own: one to post, one for the thread that reads every message as soon
as it is posted. Messages are numbered (``event/1``, ``event/2``...; the number comes from an
atomic counter), so the reader looks for the next number only (every 0.1 s). It reads eagerly
because the chief serves the store: once the chief has exited, nothing can be read any more.

A job of one worker has a `LocalBoard`, the same face with nothing to exchange.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.communication.membership.rendezvous import Rendezvous

__all__ = ["Board", "ClusterBoard", "LocalBoard", "Message", "board_for"]

log = logging.getLogger("phalanx")

STORE_TIMEOUT = 10.0  # seconds: connecting, and any single store operation of a post
READ_TIMEOUT = 5.0  # seconds: any single store operation of the reading thread
READ_INTERVAL = 0.1  # seconds between two looks for the next message
_generations = itertools.count()  # the same sequence on every worker: they run the same program
_boards: weakref.WeakKeyDictionary[Any, Board] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Message:
    kind: str  # "error", "notice" or "exit"
    task: str  # "worker:1 (127.0.0.1:2222)"
    text: str


class Board:
    """What a handler tells the other workers and learns from them (base: one worker, nothing to tell)."""

    def __init__(self) -> None:
        self._messages: list[Message] = []
        self._arrived = threading.Condition()
        self._listeners: list[weakref.WeakMethod[Callable[[Message], None]]] = []

    def subscribe(self, listener: Callable[[Message], None]) -> None:
        """Calls the bound method ``listener`` with every message from now on (on the reading
        thread; it must return quickly). Held weakly: it goes with its object."""
        self._listeners.append(weakref.WeakMethod(listener))  # type: ignore[arg-type]

    def post(self, kind: str, text: str) -> None:
        """Tells every worker (this one included) ``kind``: ``text``."""
        self._record(Message(kind, self.own_name, text))

    @property
    def own_name(self) -> str:
        return "this worker"

    def _record(self, message: Message) -> None:
        with self._arrived:
            self._messages.append(message)
            self._arrived.notify_all()
        for ref in list(self._listeners):
            listener = ref()
            if listener is not None:
                listener(message)

    def messages(self, kind: str) -> list[Message]:
        """The messages of ``kind`` seen so far, in the order they were posted."""
        with self._arrived:
            return [m for m in self._messages if m.kind == kind]

    def wait_for(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Waits up to ``timeout`` seconds until ``ready()`` holds (checked at every message)."""
        with self._arrived:
            return self._arrived.wait_for(ready, timeout)

    def peer_error(self, wait: float) -> Message | None:
        """The first error another worker posted, waiting up to ``wait`` seconds for one."""
        self.wait_for(lambda: any(m.task != self.own_name for m in self._of_kind("error")), wait)
        errors = [m for m in self.messages("error") if m.task != self.own_name]
        return errors[0] if errors else None

    def _of_kind(self, kind: str) -> list[Message]:  # caller holds the condition
        return [m for m in self._messages if m.kind == kind]

    def close(self) -> None:
        """Stops reading messages (idempotent)."""


class LocalBoard(Board):
    """The board of a job of one worker."""


class ClusterBoard(Board):
    """The board of a job of several workers, in the rendezvous store (all workers make it together).

    Args:
        rendezvous: Opens connections to the chief's store (a key prefix of this board's own).
        name: This worker's task name.
    """

    def __init__(self, rendezvous: Rendezvous, name: str) -> None:
        super().__init__()
        self._name = name
        deadline = time.monotonic() + STORE_TIMEOUT
        self._store = rendezvous.open(deadline, STORE_TIMEOUT, heartbeat=True)  # a client, also on the chief
        self._reader_store = rendezvous.open(deadline, READ_TIMEOUT, heartbeat=True)
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, name="phalanx-preemption-board", daemon=True)
        self._reader.start()
        atexit.register(self.close)

    @property
    def own_name(self) -> str:
        return self._name

    def post(self, kind: str, text: str) -> None:
        """Posts to every worker; a store that is gone (the chief exited) is logged, not raised."""
        payload = json.dumps({"kind": kind, "task": self._name, "text": text})
        try:
            number = self._store.add("events", 1)
            self._store.set(f"event/{number}", payload)
        except Exception as exc:  # reporting must never hide the error being reported
            log.warning("Could not tell the other workers that %s: %s (%s).", self._name, text, exc)

    def _read(self) -> None:
        # Polls with `check` rather than blocking in a store `wait`: a wait that times out logs a
        # warning of c10d's each time, and a thread inside a C++ call when the interpreter
        # finalizes aborts the process (`close` runs at exit, before the strategy's teardown).
        number = 1
        while not self._closing.wait(READ_INTERVAL):
            key = f"event/{number}"
            try:
                if not self._reader_store.check([key]):
                    continue
                data = json.loads(self._reader_store.get(key))
            except Exception as exc:  # the chief's store is gone, or a forged value: stop reading
                if not self._closing.is_set():
                    log.debug("The preemption board stops reading: %s", exc)
                return
            self._record(Message(str(data["kind"]), str(data["task"]), str(data["text"])))
            number += 1

    def close(self) -> None:
        atexit.unregister(self.close)
        self._closing.set()
        self._reader.join(timeout=READ_TIMEOUT + 1.0)


def board_for(strategy: Any) -> Board:
    """The board of ``strategy``'s job, made on first use (all workers, in the same order).

    Its keys live under a prefix of their own, numbered by how many boards this process made
    before (the same on every worker) and by torchrun's restart count (whose store outlives a
    restart), so that a second job never reads the first one's messages.
    """
    board = _boards.get(strategy)
    if board is not None:
        return board
    generation = next(_generations)
    if strategy.num_workers_in_sync <= 1:
        board = LocalBoard()
    else:
        membership = getattr(strategy, "membership", None)
        rank = strategy.worker_rank if membership is None else membership.me.task
        board = ClusterBoard(_rendezvous(strategy, generation), _name_of(strategy)(rank))
    _boards[strategy] = board
    return board


def _name_of(strategy: Any) -> Callable[[int], str]:
    named = getattr(strategy.cluster_resolver, "task_name", None)
    return named if callable(named) else (lambda rank: f"worker:{rank}")


def _rendezvous(strategy: Any, generation: int) -> Rendezvous:
    membership = getattr(strategy, "membership", None)
    if membership is not None:  # an elastic job: the store that outlives every worker, by task
        host, port = membership.settings.store
        return Rendezvous(
            host,
            port,
            membership.me.task,
            membership.num_tasks,
            _name_of(strategy),
            f"phalanx-preemption/elastic/{generation}/",
            True,
        )
    resolver = strategy.cluster_resolver
    host, _, port = resolver.chief_address().rpartition(":")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_store else "0"
    return Rendezvous(
        host.strip("[]"),
        int(port),
        strategy.worker_rank,
        strategy.num_workers_in_sync,
        _name_of(strategy),
        f"phalanx-preemption/{restart}/{generation}/",
        agent_store,
    )
