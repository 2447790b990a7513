"""An all-reduce among threads for compressor tests: each thread is a worker."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


class ThreadedSum:
    """``launch(rank)`` and ``wait`` for ``workers`` threads: the k-th launch of every thread is one
    all-reduce; ``wait`` meets the others, and every thread sums the tensors in rank order (the
    same bits everywhere) before any writes its result."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._meet = threading.Barrier(workers, timeout=30)
        self._calls: list[list[torch.Tensor]] = [[] for _ in range(workers)]

    def launch(self, rank: int) -> Callable[[torch.Tensor], Any]:
        def start(tensor: torch.Tensor) -> tuple[int, int]:
            self._calls[rank].append(tensor)
            return rank, len(self._calls[rank]) - 1

        return start

    def wait(self, work: tuple[int, int], what: str) -> None:
        rank, k = work
        self._meet.wait()
        total = torch.stack([self._calls[r][k] for r in range(self.workers)]).sum(0)
        self._meet.wait()
        self._calls[rank][k].copy_(total)


def on_threads(workers: int, fn: Callable[[int, ThreadedSum], Any]) -> list[Any]:
    """``fn(rank, sums)`` on ``workers`` threads at once; their results in rank order."""
    sums = ThreadedSum(workers)
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda rank: fn(rank, sums), range(workers)))
