"""TensorBoard: scalars, weight histograms and profiler traces, through ``torch.utils.tensorboard``.

Scalars and histograms are event files (optional extra ``phalanx[tensorboard]``); profiler
traces are ``torch.profiler`` Chrome traces written where TensorBoard's PyTorch profiler
plugin (``torch-tb-profiler``) finds them.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch

from phalanx.callbacks.callback import Callback, Logs
from phalanx.strategies.workers.distributed_files import (
    remove_temp_dir_with_filepath,
    strategy_of,
    write_filepath,
)

__all__ = ["TensorBoard", "parse_profile_batch"]


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # the optional extra is missing
        raise ImportError(
            "phalanx.callbacks.TensorBoard needs the tensorboard package. HINT: "
            "pip install 'phalanx[tensorboard]'."
        ) from exc
    return SummaryWriter


def _scalar(value: Any) -> float | None:
    try:
        tensor = torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    return float(tensor) if tensor.numel() == 1 else None


def _check_update_freq(update_freq: str | int) -> str | int:
    if update_freq == "batch":
        return 1
    if update_freq != "epoch" and (
        isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
    ):
        raise ValueError(
            f"update_freq must be 'epoch', 'batch' or a positive integer. Received: {update_freq!r}. "
            "HINT: update_freq=100 writes batch summaries every 100 batches."
        )
    return update_freq


def _check_histogram_freq(histogram_freq: int) -> int:
    if isinstance(histogram_freq, bool) or not isinstance(histogram_freq, int) or histogram_freq < 0:
        raise ValueError(
            f"histogram_freq must be an integer >= 0. Received: {histogram_freq!r}. "
            "HINT: histogram_freq=1 writes the weights' histograms every epoch; 0 never."
        )
    return histogram_freq


def parse_profile_batch(profile_batch: int | str | tuple[int, int] | list[int]) -> tuple[int, int] | None:
    """Keras' ``profile_batch`` as (first, last) batch, counted from 1 over the whole fit; None: off.

    Accepts 0 (off), a batch number, a pair ``(first, last)`` or the string ``"first,last"``.

    Raises:
        ValueError: Anything else, or a range that is empty or starts before batch 1.
    """
    value: Any = profile_batch
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",")]
    try:
        bounds = [int(value)] * 2 if isinstance(value, int) else [int(v) for v in value]
    except (TypeError, ValueError):
        bounds = []
    if isinstance(profile_batch, bool) or len(bounds) != 2 or bounds[0] < 0 or bounds[1] < bounds[0]:
        raise ValueError(
            "profile_batch must be 0 (off), a batch number, or a pair (first, last) of batch numbers "
            f"with 1 <= first <= last (or the string 'first,last'). Received: {profile_batch!r}. "
            "HINT: profile_batch=(10, 20) traces batches 10 to 20."
        )
    if bounds == [0, 0]:
        return None
    if bounds[0] == 0:
        raise ValueError(
            f"profile_batch counts batches from 1. Received: {profile_batch!r}. HINT: use (1, {bounds[1]})."
        )
    return bounds[0], bounds[1]


class _BatchProfiler:
    """Runs ``torch.profiler`` from the start of batch ``first`` to the end of batch ``last``."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self._profiler: Any = None

    def batch_begin(self, batch: int, trace_dir: str) -> None:
        if batch != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # <host>_<pid>.<time>.pt.trace.json: the file name torch-tb-profiler looks for.
        handler = torch.profiler.tensorboard_trace_handler(
            trace_dir, worker_name=f"{socket.gethostname()}_{os.getpid()}"
        )
        self._profiler = torch.profiler.profile(activities=activities, on_trace_ready=handler)
        self._profiler.start()

    def batch_end(self, batch: int) -> None:
        if batch == self.last:
            self.stop()

    def stop(self) -> None:
        """Stops a running trace and writes it (also when training ends before the last batch)."""
        if self._profiler is not None:
            self._profiler.stop()  # calls the trace handler: the file is written here
            self._profiler = None


class TensorBoard(Callback):
    """Writes the logs as TensorBoard scalars, weight histograms and profiler traces, Keras' layout.

    ``<log_dir>/train`` gets ``epoch_<key>`` for every epoch (and ``batch_<key>`` every
    ``update_freq`` batches when it is an integer); ``<log_dir>/validation`` gets the
    ``val_`` keys without their prefix. With ``histogram_freq=N`` the train folder also gets
    a histogram of every floating weight and buffer of the model (tag ``<name>``, as the
    state dict names it) every N epochs, starting with the first. With ``profile_batch``, a
    ``torch.profiler`` trace of those batches goes to
    ``<log_dir>/train/plugins/profile/<time>/<host>_<pid>.<ms>.pt.trace.json``: open it with
    ``pip install torch-tb-profiler`` in TensorBoard's PYTORCH_PROFILER tab (or in Chrome's
    ``chrome://tracing``). Every worker runs the callback; the chief writes ``log_dir``, the
    others a temporary folder that is removed when training ends.

    Args:
        log_dir: Folder of the event files.
        histogram_freq: Epochs between weight histograms (0: none).
        update_freq: "epoch", "batch" (= 1) or a number of batches.
        profile_batch: Batches to trace, counted from 1 over the whole ``fit``: 0 (off), a
            batch number, ``(first, last)`` or ``"first,last"``.

    Raises:
        ImportError: tensorboard is not installed (``pip install 'phalanx[tensorboard]'``).
        ValueError: ``update_freq``, ``histogram_freq`` or ``profile_batch`` is not one of
            the accepted values.
    """

    def __init__(
        self,
        log_dir: str = "logs",
        histogram_freq: int = 0,
        update_freq: str | int = "epoch",
        profile_batch: int | str | tuple[int, int] = 0,
    ) -> None:
        super().__init__()
        self._writer_class = _summary_writer_class()
        self.log_dir = os.fspath(log_dir)
        self.update_freq = _check_update_freq(update_freq)
        self.histogram_freq = _check_histogram_freq(histogram_freq)
        bounds = parse_profile_batch(profile_batch)
        self._profiler = _BatchProfiler(*bounds) if bounds is not None else None
        self._writers: dict[str, Any] = {}
        self._write_dir = self.log_dir
        self._train_step = 0

    def _writer(self, kind: str) -> Any:
        if kind not in self._writers:
            self._writers[kind] = self._writer_class(os.path.join(self._write_dir, kind))
        return self._writers[kind]

    def on_train_begin(self, logs: Logs = None) -> None:
        self._write_dir = write_filepath(self.log_dir, strategy_of(self.model))
        self._train_step = 0

    def on_train_batch_begin(self, batch: int, logs: Logs = None) -> None:
        if self._profiler is not None:
            run = time.strftime("%Y_%m_%d_%H_%M_%S")
            trace_dir = os.path.join(self._write_dir, "train", "plugins", "profile", run)
            self._profiler.batch_begin(self._train_step + 1, trace_dir)

    def reads_batch_logs(self, mode: str = "train") -> bool:
        """Writing batch summaries (``update_freq`` a number of steps) reads the training logs."""
        return super().reads_batch_logs(mode) and (mode != "train" or isinstance(self.update_freq, int))

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        self._train_step += 1
        if self._profiler is not None:
            self._profiler.batch_end(self._train_step)
        if isinstance(self.update_freq, int) and self._train_step % self.update_freq == 0:
            self._write("train", "batch_", logs or {}, self._train_step)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        logs = logs or {}
        self._write("train", "epoch_", {k: v for k, v in logs.items() if not k.startswith("val_")}, epoch)
        validation = {k.removeprefix("val_"): v for k, v in logs.items() if k.startswith("val_")}
        if validation:
            self._write("validation", "epoch_", validation, epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            self._write_histograms(epoch)

    def _write_histograms(self, epoch: int) -> None:
        # The state dict read outside `run`: plain tensors (sync-on-read buffers aggregated).
        writer = self._writer("train")
        module = getattr(self.model, "module", self.model)  # a phalanx.Model's wrapped module
        for name, value in module.state_dict().items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                writer.add_histogram(name, value.detach().float().cpu(), epoch)
        writer.flush()

    def _write(self, kind: str, prefix: str, logs: dict[str, Any], step: int) -> None:
        writer = self._writer(kind)
        for key, value in logs.items():
            scalar = _scalar(value)
            if scalar is not None:
                writer.add_scalar(f"{prefix}{key}", scalar, step)
        writer.flush()

    def on_train_end(self, logs: Logs = None) -> None:
        if self._profiler is not None:
            self._profiler.stop()
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
        remove_temp_dir_with_filepath(self._write_dir, strategy_of(self.model))
