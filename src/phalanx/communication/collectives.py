"""Cross-process collectives with deadlines and a health check (the transport of MultiWorkerMirroredStrategy).

Bounds (defaults): joining waits ``join_timeout`` (120 s) and logs every 5 s which tasks it
still waits for; a worker that dies is reported as soon as its sockets close (SIGKILL:
at once) or, if it stops answering, when its heartbeat is ``heartbeat_timeout`` (10 s)
old — every collective polls the health check, so the bound is heartbeat_timeout plus a
poll interval (< 12 s). A collective that does not finish in ``collective_timeout`` fails
too. Each error names the missing tasks.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PeerUnavailableError", "WorkerGroup"]

log = logging.getLogger("phalanx")


class PeerUnavailableError(RuntimeError):
    """Another worker died, stopped answering, or never joined."""


class WorkerGroup:
    """A torch.distributed process group of the workers, with check-in and heartbeats.

    Args:
        host, port: The chief's address; its TCPStore is the rendezvous.
        rank, world_size: This worker and the number of workers.
        backend: "gloo" or "nccl".
        task_name: ``fn(rank) -> "worker:1 (host:port)"`` for messages.
        join_timeout, collective_timeout, heartbeat_timeout: Seconds (see module docstring).
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        task_name: Callable[[int], str],
        join_timeout: float = 120.0,
        collective_timeout: float = 300.0,
        heartbeat_timeout: float = 10.0,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._name = task_name
        self._collective_timeout = collective_timeout
        self._heartbeat_timeout = heartbeat_timeout
        self._failure: str | None = None
        self._stop = threading.Event()
        self._store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=join_timeout),
            wait_for_workers=False,
        )
        self._check_in(join_timeout)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("phalanx/pg", self._store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        self._group = dist.group.WORLD
        self._heartbeat = threading.Thread(
            target=self._beat, args=(host, port), name="phalanx-heartbeat", daemon=True
        )
        self._heartbeat.start()
        # A daemon thread stopped inside a store call at interpreter exit aborts the process.
        atexit.register(self._stop_heartbeat)

    # ---------------------------------------------------------------- joining and health
    def _check_in(self, deadline_s: float) -> None:
        self._store.set(f"phalanx/joined/{self.rank}", "1")
        start = last_log = time.monotonic()
        while True:
            missing = [r for r in range(self.world_size) if not self._store.check([f"phalanx/joined/{r}"])]
            if not missing:
                return
            waited = time.monotonic() - start
            if waited > deadline_s:
                raise PeerUnavailableError(
                    f"Gave up after {deadline_s:.0f}s waiting for {[self._name(r) for r in missing]} "
                    "to join. "
                    "HINT: start every task of TF_CONFIG's cluster, and check their addresses."
                )
            if time.monotonic() - last_log > 5:
                log.warning("Still waiting for %s to join (%.0fs).", [self._name(r) for r in missing], waited)
                last_log = time.monotonic()
            time.sleep(0.05)

    def _beat(self, host: str, port: int) -> None:
        try:
            store = dist.TCPStore(host, port, self.world_size, is_master=False, timeout=timedelta(seconds=10))
        except Exception as exc:  # the chief's store is gone
            log.debug("heartbeat store unreachable", exc_info=True)
            self._failure = f"the chief {self._name(0)} is unreachable ({exc})"
            return
        seen: dict[int, tuple[str, float]] = {}
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                store.set(f"phalanx/heartbeat/{self.rank}", str(time.time()))
                for peer in range(self.world_size):
                    if peer == self.rank:
                        continue
                    value = (
                        store.get(f"phalanx/heartbeat/{peer}").decode()
                        if store.check([f"phalanx/heartbeat/{peer}"])
                        else ""
                    )
                    if peer not in seen or seen[peer][0] != value:
                        seen[peer] = (value, now)  # alive: its heartbeat changed
                    elif now - seen[peer][1] > self._heartbeat_timeout:
                        self._failure = (
                            f"{self._name(peer)} stopped sending heartbeats {now - seen[peer][1]:.1f}s ago"
                        )
            except Exception as exc:  # the store (on the chief) died
                log.debug("heartbeat failed", exc_info=True)
                self._failure = self._failure or f"the chief {self._name(0)} is unreachable ({exc!r})"
            self._stop.wait(1.0)

    def _raise_failure(self, what: str, cause: BaseException | None = None) -> None:
        raise PeerUnavailableError(
            f"{what} failed on {self._name(self.rank)}: {self._failure}. "
            "HINT: check that task's log; restart the job (BackupAndRestore resumes it)."
        ) from cause

    def _wait(self, work: Any, what: str, timeout: float | None = None) -> None:
        limit = self._collective_timeout if timeout is None else timeout
        start = time.monotonic()
        pause = 0.00005  # sleep, never spin: gloo threads need the cores
        while True:
            try:
                if work.is_completed():
                    work.wait()
                    return
            except RuntimeError as exc:  # a peer's socket closed: name it
                self._blame(exc, what)
            if self._failure is not None:
                self._raise_failure(what)
            if time.monotonic() - start > limit:
                self._failure = f"no answer within {limit:g}s"
                self._raise_failure(what)
            time.sleep(pause)
            pause = min(0.0005, pause * 1.5)

    def _blame(self, exc: RuntimeError, what: str) -> None:
        deadline = time.monotonic() + self._heartbeat_timeout + 2
        while self._failure is None and time.monotonic() < deadline:
            if self.world_size == 2:
                self._failure = f"{self._name(1 - self.rank)} closed its connection ({exc})"
            time.sleep(0.2)
        self._failure = self._failure or f"a peer closed its connection ({exc})"
        self._raise_failure(what, exc)

    # ---------------------------------------------------------------- collectives (all workers)
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        what: str = "all_reduce",
        timeout: float | None = None,
    ) -> torch.Tensor:
        """In-place all-reduce of a contiguous tensor (every worker, same shape and dtype).

        ``timeout`` overrides the group's collective timeout for this call.
        """
        if self._failure is not None:
            self._raise_failure(what)
        self._wait(dist.all_reduce(tensor, op=op, async_op=True), what, timeout)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from worker ``src`` (every worker)."""
        self._wait(dist.broadcast(tensor, src, async_op=True), "broadcast")
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's tensor (same shape everywhere), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, tensor.contiguous(), async_op=True), "all_gather")
        return out

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._heartbeat.is_alive() and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=15)

    def close(self) -> None:
        """Stops the heartbeat and destroys the process group (every worker)."""
        self._stop_heartbeat()
        if dist.is_initialized():
            dist.destroy_process_group()
