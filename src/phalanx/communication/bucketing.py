"""DDP-style gradient buckets: all-reduce gradients while backward is still running.

Used by MultiWorkerMirroredStrategy with one local replica, where parameters stay plain
``nn.Parameter``s. Parameters are grouped into buckets of about ``bucket_bytes`` in reverse
creation order (the order backward produces gradients); when every gradient of a bucket has
arrived (``register_post_accumulate_grad_hook``), the bucket's all-reduce starts
asynchronously. Buckets are launched strictly in index order on every worker, so the
collectives match across workers. ``optimizer.step()`` waits for all buckets and installs
the sums as views of the bucket buffers.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradientBuckets"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024  # small, so the last layers' gradients start moving early (as DDP)


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.buffer = torch.zeros(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        offsets, start = [], 0
        for p in params:
            offsets.append(start)
            start += p.numel()
        self.offsets = offsets
        self.ready: set[int] = set()
        self.work: Any = None

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


class GradientBuckets:
    """Overlapped gradient all-reduce for the parameters one worker created in scope.

    Args:
        is_active: Whether a backward belongs to a step of the strategy (inside its ``run``).
        wait: ``wait(work, what)`` — waits for an async collective with the strategy's deadline.
        bucket_bytes: Bucket size (0: 25 MiB, as DDP).
    """

    def __init__(
        self, is_active: Callable[[], bool], wait: Callable[[Any, str], None], bucket_bytes: int = 0
    ) -> None:
        self._is_active = is_active
        self._wait = wait
        self._bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        self._params: list[weakref.ref[torch.nn.Parameter]] = []
        self._buckets: list[_Bucket] | None = None
        self._where: dict[int, tuple[int, int]] = {}
        self._next_launch = 0
        self._lock = threading.Lock()

    def add(self, param: torch.nn.Parameter) -> None:
        """Tracks a parameter created in the strategy's scope."""
        if param.requires_grad:
            self._params.append(weakref.ref(param))
            self._buckets = None  # rebuilt before the next backward
            param.register_post_accumulate_grad_hook(self._on_grad)

    def _build(self) -> list[_Bucket]:
        params = [p for p in (ref() for ref in reversed(self._params)) if p is not None]
        buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in params:
            if current and (
                size + p.numel() * p.element_size() > self._bucket_bytes or p.dtype != current[0].dtype
            ):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(_Bucket(current))
        self._where = {id(p): (b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket.params)}
        return buckets

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._is_active():
            return
        with self._lock:
            if self._buckets is None:
                self._buckets = self._build()
            b, i = self._where[id(param)]
            bucket = self._buckets[b]
            assert param.grad is not None
            bucket.view(i).copy_(param.grad)
            bucket.ready.add(i)
            self._launch_ready()

    def _launch_ready(self) -> None:
        assert self._buckets is not None
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
            self._next_launch += 1

    def synchronize(self) -> None:
        """Waits for every bucket and installs the summed gradients (before optimizer.step)."""
        with self._lock:
            if self._buckets is None:
                self._buckets = self._build()
            for bucket in self._buckets:  # parameters that got no gradient count as zeros
                for i in range(len(bucket.params)):
                    if i not in bucket.ready:
                        bucket.view(i).zero_()
                        bucket.ready.add(i)
            self._launch_ready()
            for bucket in self._buckets:
                self._wait(bucket.work, "the gradient all-reduce")
                for i, p in enumerate(bucket.params):
                    p.grad = bucket.view(i)
                bucket.ready.clear()
                bucket.work = None
            self._next_launch = 0
