"""What a task publishes for the status page, and how the page's server collects it.

Every task of a job with the status page on runs a `Reporter`: a daemon thread that, every
half second, sends one small JSON report over HTTP to the page's server (``POST /report``,
with the cluster token when the job has one). A report says who the task is (``task``,
``pid``, host), its ``state`` (``joining`` until its worker group formed, ``running``, ``done``
once it closed), its step count, its rates over the last `WINDOW` seconds (steps per second,
the fraction of wall time it waited for collectives, closures per second per worker on a
parameter-server chief), its resident memory, its membership epoch and its last error. The
rates come from `phalanx.status.counters`, which the worker group and the strategy add to.

Reports travel to the page, not through the rendezvous store: the store lives in the chief
(or, in an elastic job, in the launcher), and the page must go on showing the job when the
chief is the task that was lost. A report costs one loopback or LAN round trip every half
second on a thread of its own, never on the training thread.

The server keeps them on a `phalanx.status.board.Board`, which takes a task that has not
reported for `LOST_AFTER` seconds (the heartbeat timeout's default: the same bound within
which its peers declare it lost) for ``lost``.
"""

from __future__ import annotations

import atexit
import http.client
import json
import logging
import os
import resource
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.status.counters import COUNTERS, Counters

__all__ = ["INTERVAL", "LOST_AFTER", "STATES", "TOKEN_HEADER", "WINDOW", "Reporter", "resident_memory"]

log = logging.getLogger("phalanx")

INTERVAL = 0.5  # seconds between two reports of a task
WINDOW = 5.0  # seconds the rates are measured over
# phalanx.communication.checks.health.DEFAULT_HEARTBEAT_TIMEOUT (not imported: it would import torch)
LOST_AFTER = 10.0
TOKEN_HEADER = "X-Phalanx-Token"  # noqa: S105 - a header's name, not a secret
STATES = ("joining", "running", "done")


def resident_memory() -> int:
    """This process's resident set size in bytes (its peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024


@dataclass
class _Sample:
    at: float
    waited: float
    steps: int
    requests: int
    closures: dict[str, int]


class Reporter:
    """Sends this task's report to the page's server every `INTERVAL` (every task).

    Args:
        task: ``"worker:1"``.
        address: The server's ``HOST:PORT``.
        token: The cluster token, sent with every report (None: the job has none).
        epoch: Returns the task's membership epoch (None: not an elastic job).
        counters: What the task counts (the process's `COUNTERS`).
        clock: Monotonic clock.
    """

    def __init__(
        self,
        task: str,
        address: str,
        token: str | None,
        epoch: Callable[[], int | None] = lambda: None,
        counters: Counters = COUNTERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.task, self._address, self._token = task, address, token
        self._epoch, self._counters, self._clock = epoch, counters, clock
        self.state = "joining"
        self._samples: deque[_Sample] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._host = socket.gethostname()
        self._at_exit_registered = False

    # ---------------------------------------------------------------- what a report says
    def report(self) -> dict[str, Any]:
        """This task's report now (also advances the rates' window)."""
        now, reading = self._clock(), self._counters.reading()
        closures = reading.closures
        done = {worker: c.done for worker, c in closures.items()}
        self._samples.append(
            _Sample(now, reading.collective_wait_seconds, reading.steps, reading.requests, done)
        )
        while len(self._samples) > 2 and now - self._samples[1].at >= WINDOW:
            self._samples.popleft()
        first = self._samples[0]
        span = now - first.at

        def rate(now_value: float, then: float) -> float | None:
            return (now_value - then) / span if span >= 1.0 else None

        wait = rate(reading.collective_wait_seconds, first.waited)
        report: dict[str, Any] = {
            "task": self.task,
            "pid": os.getpid(),
            "host": self._host,
            "state": self.state,
            "step": reading.steps,
            "total_steps": reading.total_steps,
            "steps_per_second": rate(reading.steps, first.steps),
            "collective_wait_fraction": None if wait is None else min(1.0, wait),
            "requests_per_second": rate(reading.requests, first.requests),
            "resident_memory_bytes": resident_memory(),
            "membership_epoch": self._epoch(),
            "last_error": reading.last_error,
        }
        if closures:
            report["closures"] = {
                worker: {
                    "done": c.done,
                    "lost": c.lost,
                    "rescheduled": c.rescheduled,
                    "per_second": rate(c.done, first.closures.get(worker, 0)),
                }
                for worker, c in sorted(closures.items())
            }
        return report

    # ---------------------------------------------------------------- sending
    def send(self, timeout: float = 2.0) -> bool:
        """Sends one report; False when the server did not take it (not up yet, gone)."""
        body = json.dumps(self.report()).encode()
        host, _, port = self._address.rpartition(":")
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers[TOKEN_HEADER] = self._token
        connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
        try:
            connection.request("POST", "/report", body, headers)
            answer = connection.getresponse()
            answer.read()
            return answer.status == 204
        except OSError:
            log.debug("status report to %s failed", self._address, exc_info=True)
            return False
        finally:
            connection.close()

    def start(self) -> None:
        """Starts the reporting thread (it sends the first report at once)."""
        self._thread = threading.Thread(target=self._run, name="phalanx-status-report", daemon=True)
        self._thread.start()
        if not self._at_exit_registered:
            self._at_exit_registered = True
            atexit.register(self._at_exit)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.send()
            self._stop.wait(INTERVAL)

    def stop(self, state: str = "done") -> None:
        """Stops the thread (waits up to 5 s) and sends a last report with ``state``."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        self.state = state
        self.send()

    def _at_exit(self) -> None:
        """A process that exits without closing its strategy: done, unless it met an error."""
        if not self._stop.is_set():
            failed = self._counters.reading().last_error is not None
            self.stop("lost" if failed else "done")
