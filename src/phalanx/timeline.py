"""A Horovod-style timeline: where each step's time goes, as a Chrome trace per task.

Set ``PHALANX_TIMELINE=/path/trace.json`` (or call `start`) and every task writes
``/path/trace.<task>.json`` (``<task>``: ``chief-0``, ``worker-1``, ``ps-0``, ``rank-3`` or
``local``) when it exits, and every few seconds while it runs
(``PHALANX_TIMELINE_FLUSH_SECONDS``, default 5), so a task stopped by a signal keeps its
trace. It holds the forward and backward passes of the outermost module, optimizer steps,
the waits for gradient all-reduces and other cross-worker collectives, and parameter-server
reads and pushes, each a span on the thread that ran it. Open the file in
``chrome://tracing`` or https://ui.perfetto.dev; ``scripts/plot_timeline.py`` draws it.

Spans cost nothing while the timeline is off: `span` returns a shared no-op context.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from phalanx import settings

__all__ = ["is_enabled", "span", "start", "stop", "task_name", "write"]

ENV_VAR = "PHALANX_TIMELINE"
MAX_EVENTS = 1_000_000  # ~150 MB of JSON; later events are counted, not kept

_NULL = contextlib.nullcontext()


class Timeline:
    """Collects complete-duration events ("ph": "X") in memory; `write` saves them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._thread_names: dict[int, str] = {}
        self.dropped = 0

    @contextlib.contextmanager
    def span(self, name: str, category: str, args: dict[str, Any] | None = None) -> Iterator[None]:
        """Records the time spent inside the ``with`` block as one event."""
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, category, start, time.perf_counter_ns(), args)

    def add(self, name: str, category: str, start_ns: int, end_ns: int, args: dict[str, Any] | None) -> None:
        """Adds one event from ``start_ns`` to ``end_ns`` (``time.perf_counter_ns`` values)."""
        thread = threading.current_thread()
        event: dict[str, Any] = {
            "name": name,
            "cat": category,
            "ph": "X",
            "ts": start_ns / 1000,
            "dur": (end_ns - start_ns) / 1000,
            "pid": self._pid,
            "tid": thread.ident,
        }
        if args:
            event["args"] = args
        with self._lock:
            self._thread_names.setdefault(thread.ident or 0, thread.name)
            if len(self._events) < MAX_EVENTS:
                self._events.append(event)
            else:
                self.dropped += 1

    @property
    def recorded(self) -> int:
        """Events seen so far, kept or dropped (the periodic flush writes when it changes)."""
        with self._lock:
            return len(self._events) + self.dropped

    def write(self) -> Path:
        """Writes every event so far as Chrome-trace JSON (atomically) and returns the path."""
        with self._lock:
            events = list(self._events)
            threads = [
                {"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid, "args": {"name": name}}
                for tid, name in self._thread_names.items()
            ]
        name = task_name() + (f" ({self.dropped} events dropped)" if self.dropped else "")
        meta = {"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": name}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{self._pid}")
        tmp.write_text(json.dumps({"traceEvents": [meta, *threads, *events], "displayTimeUnit": "ms"}))
        os.replace(tmp, self.path)
        return self.path


_timeline: Timeline | None = None
_hook_handles: list[Any] = []
_local = threading.local()


def task_name() -> str:
    """This process's task: from ``TF_CONFIG`` (``worker-1``), else ``RANK`` (``rank-1``), else ``local``."""
    try:
        task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task") or {}
    except (ValueError, AttributeError):
        task = {}
    if isinstance(task, dict) and "type" in task:
        return f"{task['type']}-{task.get('index', 0)}"
    if "RANK" in os.environ:
        return f"rank-{os.environ['RANK']}"
    return "local"


def is_enabled() -> bool:
    """Whether a timeline is being recorded in this process."""
    return _timeline is not None


def span(name: str, category: str = "phalanx", args: dict[str, Any] | None = None) -> Any:
    """A context manager that records its block on the timeline (a no-op while it is off).

    Args:
        name: What the span shows, e.g. ``"all-reduce bucket 3"``.
        category: A group for filtering in the viewer (``"collective"``, ``"ps"``, ...).
        args: Small JSON-able details shown when the span is selected.
    """
    timeline = _timeline
    return _NULL if timeline is None else timeline.span(name, category, args)


def start(path: str | os.PathLike[str] | None = None) -> Path:
    """Starts recording; the trace is written to ``path`` with the task name before ``.json``.

    Args:
        path: Where to write; defaults to ``$PHALANX_TIMELINE``.

    Returns:
        The file this process will write.

    Raises:
        ValueError: No path was given and ``PHALANX_TIMELINE`` is not set.
    """
    global _timeline
    raw = path if path is not None else settings.current().timeline
    if not raw:
        raise ValueError(
            f"A timeline needs a file to write. Received: no path and {ENV_VAR} unset. "
            f"HINT: {ENV_VAR}=/tmp/trace.json python train.py, or phalanx.timeline.start('/tmp/trace.json')."
        )
    base = Path(raw)
    stem = base.name[: -len(".json")] if base.name.endswith(".json") else base.name
    target = base.with_name(f"{stem}.{task_name()}.json")
    if _timeline is None:
        _timeline = Timeline(target)
        _install_hooks()
        atexit.register(write)
        # Tasks stopped by a signal (ps tasks and PS workers when the chief is done) skip
        # atexit: a daemon thread rewrites the file every few seconds while events arrive.
        threading.Thread(
            target=_flush_periodically, args=(_timeline,), name="phalanx-timeline", daemon=True
        ).start()
    return _timeline.path


def _flush_periodically(timeline: Timeline) -> None:
    seconds = settings.current().timeline_flush_seconds
    written = 0
    while _timeline is timeline:
        time.sleep(seconds)
        count = timeline.recorded
        if _timeline is timeline and count != written:
            timeline.write()
            written = count


def write() -> Path | None:
    """Writes the events recorded so far (also done at exit); None when the timeline is off."""
    return _timeline.write() if _timeline is not None else None


def stop() -> Path | None:
    """Writes the trace and stops recording; returns the file written (None if it was off)."""
    global _timeline
    written = write()
    for handle in _hook_handles:
        handle.remove()
    _hook_handles.clear()
    _uninstall_backward()
    _timeline = None
    return written


# ---------------------------------------------------------------- the hooks a user's step passes
def _forward_pre(module: torch.nn.Module, args: Any) -> None:
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    if depth == 0:  # the outermost module: one span per forward pass, not one per layer
        _local.forward_start = time.perf_counter_ns()


def _forward_post(module: torch.nn.Module, args: Any, output: Any) -> None:
    _local.depth = getattr(_local, "depth", 1) - 1
    timeline = _timeline
    if _local.depth == 0 and timeline is not None:
        timeline.add(
            f"forward {type(module).__name__}", "forward", _local.forward_start, time.perf_counter_ns(), None
        )


def _step_pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _local.step_start = time.perf_counter_ns()


def _step_post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    timeline = _timeline
    if timeline is not None and hasattr(_local, "step_start"):
        timeline.add(
            f"{type(optimizer).__name__}.step", "optimizer", _local.step_start, time.perf_counter_ns(), None
        )


_original_backward = torch.Tensor.backward


def _timed_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    with span("backward", "backward"):
        return _original_backward(self, *args, **kwargs)


def _install_hooks() -> None:
    from torch.nn.modules import module as module_hooks
    from torch.optim import optimizer as optimizer_hooks

    _hook_handles.extend(
        [
            module_hooks.register_module_forward_pre_hook(_forward_pre),
            module_hooks.register_module_forward_hook(_forward_post, always_call=True),
            optimizer_hooks.register_optimizer_step_pre_hook(_step_pre),
            optimizer_hooks.register_optimizer_step_post_hook(_step_post),
        ]
    )
    torch.Tensor.backward = _timed_backward  # type: ignore[method-assign]  # opt-in tracing only


def _uninstall_backward() -> None:
    torch.Tensor.backward = _original_backward  # type: ignore[method-assign]


if settings.current().timeline:
    start()
