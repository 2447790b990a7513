"""The page's view of a job: the last report of every task, its events, and what they add up to.

The status server (`phalanx.status.server`) hands every report a task sends to `Board.receive`
and answers ``/status.json`` and the page from `Board.snapshot`: one row per task (``lost``
once it has not reported for `phalanx.status.reports.LOST_AFTER` seconds, or at once when the
launcher saw its process fail), the straggler (`phalanx.status.straggler`), the job's
membership epoch, step and ETA, its events, and a parameter-server job's closures and ps load.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phalanx.status.reports import LOST_AFTER, STATES
from phalanx.status.straggler import find_straggler

__all__ = ["MAX_EVENTS", "Board"]

MAX_EVENTS = 200


@dataclass
class _Task:
    report: dict[str, Any]
    seen: float
    lost_reason: str | None = None
    first_seen: float = field(default=0.0)


class Board:
    """The server's view of the job: the last report of every task, and the events (the
    server's thread and the HTTP handlers; thread-safe).

    Args:
        secrets: Strings never shown (the cluster token): replaced by ``***``.
        lost_after: Seconds without a report before a task is lost.
        clock: Monotonic clock; ``wall``: the wall clock, for event times.
    """

    def __init__(
        self,
        secrets: tuple[str, ...] = (),
        lost_after: float = LOST_AFTER,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._secrets = tuple(s for s in secrets if s)
        self._lost_after, self._clock, self._wall = lost_after, clock, wall
        self._tasks: dict[str, _Task] = {}
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._started = clock()
        self._epoch: int | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- reports in
    def receive(self, report: Any) -> None:
        """Takes one task's report.

        Raises:
            ValueError: The report is not a JSON object with a task name, a pid and a known state.
        """
        _check_report(report)
        now = self._clock()
        with self._lock:
            self._mark_lost(now)
            self._note_epoch(report)
            name = report["task"]
            known = self._tasks.get(name)
            if known is None:
                self._event(name, "joined", f"pid {report['pid']} on {report['host']}")
                self._tasks[name] = _Task(report, now, first_seen=now)
                return
            if known.report["pid"] != report["pid"]:
                self._event(name, "joined", f"restarted: pid {report['pid']} on {report['host']}")
            elif (known.lost_reason is not None or known.report["state"] == "done") and report[
                "state"
            ] != "lost":
                if report["state"] != "done":
                    self._event(name, "joined", "reports again")
            elif report["state"] == "done" and known.report["state"] != "done":
                self._event(name, "done", "closed its strategy")
            elif report["state"] == "lost" and known.lost_reason is None:
                self._event(name, "left", f"exited after an error: {report.get('last_error')}")
            known.report, known.seen = report, now
            known.lost_reason = "exited after an error" if report["state"] == "lost" else None

    def _note_epoch(self, report: dict[str, Any]) -> None:
        epoch = report.get("membership_epoch")
        if isinstance(epoch, int) and (self._epoch is None or epoch > self._epoch):
            self._epoch = epoch
            self._event("job", "membership", f"epoch {epoch} (first reported by {report['task']})")

    def task_exited(self, name: str, how: str) -> None:
        """A task's process failed (the launcher saw it exit): lost at once unless it was done."""
        with self._lock:
            known = self._tasks.get(name)
            if known is None or known.report["state"] == "done":
                return
            if known.lost_reason is None:
                known.lost_reason = how
                self._event(name, "left", how)

    def _mark_lost(self, now: float) -> None:
        for name, task in self._tasks.items():
            silent = now - task.seen
            if task.lost_reason is None and task.report["state"] != "done" and silent > self._lost_after:
                task.lost_reason = f"no report for {silent:.0f}s (the process is gone or hung)"
                self._event(name, "left", task.lost_reason)

    def _event(self, task: str, what: str, reason: str) -> None:
        self._events.append({"time": self._wall(), "task": task, "event": what, "reason": reason})

    # ---------------------------------------------------------------- the view out
    def snapshot(self) -> dict[str, Any]:
        """The job as ``/status.json`` shows it (every string scrubbed of secrets)."""
        now = self._clock()
        with self._lock:
            self._mark_lost(now)
            rows = [self._row(name, task, now) for name, task in sorted(self._tasks.items(), key=_task_order)]
            events = list(self._events)
        running = {r["task"]: r["collective_wait_fraction"] for r in rows if r["state"] == "running"}
        straggler = find_straggler({k: v for k, v in running.items() if v is not None})
        for row in rows:
            row["straggler"] = row["task"] == straggler
        view = {
            "job": self._job(rows, straggler, now),
            "workers": rows,
            "events": events,
            "parameter_server": _parameter_server(rows),
        }
        return self._scrub(view)

    def _row(self, name: str, task: _Task, now: float) -> dict[str, Any]:
        report = task.report
        state = "lost" if task.lost_reason is not None else report["state"]
        return {
            "task": name,
            "pid": report["pid"],
            "host": report["host"],
            "state": state,
            "lost_reason": task.lost_reason,
            "step": report.get("step"),
            "steps_per_second": report.get("steps_per_second") if state == "running" else None,
            "collective_wait_fraction": report.get("collective_wait_fraction")
            if state == "running"
            else None,
            "resident_memory_bytes": report.get("resident_memory_bytes"),
            "membership_epoch": report.get("membership_epoch"),
            "last_error": report.get("last_error"),
            "seconds_since_report": round(now - task.seen, 1),
            "closures": report.get("closures"),
            "requests_per_second": report.get("requests_per_second") if state == "running" else None,
            "total_steps": report.get("total_steps"),
        }

    def _job(self, rows: list[dict[str, Any]], straggler: str | None, now: float) -> dict[str, Any]:
        running = [r for r in rows if r["state"] == "running"]
        epochs = [r["membership_epoch"] for r in rows if r["membership_epoch"] is not None]
        steps = [r["step"] for r in running if r["step"] is not None]
        rates = [r["steps_per_second"] for r in running if r["steps_per_second"]]
        totals = [r["total_steps"] for r in rows if r["total_steps"] is not None]
        step, total = (max(steps) if steps else None), (max(totals) if totals else None)
        eta = None
        if step is not None and total is not None and rates:
            eta = max(0, total - step) / statistics.median(rates)
        return {
            "elapsed_seconds": round(now - self._started, 1),
            "membership_epoch": max(epochs) if epochs else None,
            "workers": {state: sum(r["state"] == state for r in rows) for state in (*STATES, "lost")},
            "step": step,
            "total_steps": total,
            "eta_seconds": eta,
            "straggler": straggler,
        }

    def _scrub(self, value: Any) -> Any:
        if isinstance(value, str):
            for secret in self._secrets:
                value = value.replace(secret, "***")
            return value
        if isinstance(value, dict):
            return {k: self._scrub(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._scrub(v) for v in value]
        return value


def _check_report(report: Any) -> None:
    ok = (
        isinstance(report, dict)
        and isinstance(report.get("task"), str)
        and isinstance(report.get("pid"), int)
        and isinstance(report.get("host"), str)
        and report.get("state") in (*STATES, "lost")
    )
    if not ok:
        shown = sorted(report) if isinstance(report, dict) else type(report).__name__
        raise ValueError(
            "A status report must be a JSON object with 'task' (str), 'pid' (int), 'host' (str) and "
            f"'state' (one of {[*STATES, 'lost']}). Received: {shown}. HINT: reports come from "
            "phalanx.status.reports.Reporter; check that the sender runs the same phalanx version."
        )


def _task_order(item: tuple[str, _Task]) -> tuple[int, str, int]:
    job, _, index = item[0].partition(":")
    order = {"chief": 0, "worker": 1, "ps": 2, "evaluator": 3}.get(job, 4)
    return order, job, int(index) if index.isdigit() else 0


def _parameter_server(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Closures per worker (from the chief's report) and each ps task's load, if any."""
    closures = next((r["closures"] for r in rows if r.get("closures")), None)
    ps = [r for r in rows if r["task"].startswith("ps:")]
    if closures is None and not ps:
        return None
    return {
        "closures": closures or {},
        "lost_closures": sum(c["lost"] for c in (closures or {}).values()),
        "rescheduled_closures": sum(c["rescheduled"] for c in (closures or {}).values()),
        "ps_tasks": {
            r["task"]: {"state": r["state"], "requests_per_second": r["requests_per_second"]} for r in ps
        },
    }
