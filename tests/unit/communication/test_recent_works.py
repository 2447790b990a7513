"""RecentWorks: a work is held from Python until it completed and either `keep_seconds` passed
or `keep_count` newer works were started."""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from phalanx.communication.group.recent_works import RecentWorks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Work:
    def __init__(self, completed: bool = True) -> None:
        self.completed = completed

    def is_completed(self) -> bool:
        return self.completed


def test_a_completed_work_is_let_go_only_after_keep_seconds():
    clock = Clock()
    works = RecentWorks(keep_seconds=2.0, clock=clock)
    first = Work()
    assert works.add(first) is first
    clock.now += 1.0
    works.add(Work())
    assert len(works) == 2  # the first is 1 s old: still held
    clock.now += 1.5
    works.add(Work())
    assert len(works) == 2  # the first is 2.5 s old and done: gone; the second is 1.5 s old


def test_a_completed_work_is_let_go_sooner_once_keep_count_newer_works_started():
    """A training loop starts a few works a step: holding each for seconds kept every
    gradient of those seconds alive (and made malloc fault their pages in again each step)."""
    clock = Clock()
    works = RecentWorks(keep_seconds=2.0, clock=clock, keep_count=4)
    held = [works.add(Work()) for _ in range(10)]
    assert len(works) == 4  # no time passed: only the count let the older six go
    assert works.pending() == []
    running = works.add(Work(completed=False))
    for _ in range(10):
        works.add(Work())
    assert running in works.pending()  # however many came after, a running work stays
    running.completed = True
    works.add(Work())
    assert len(works) == 4
    del held


def test_a_work_still_running_is_held_however_old():
    clock = Clock()
    works = RecentWorks(keep_seconds=2.0, clock=clock)
    running = Work(completed=False)
    works.add(running)
    clock.now += 60.0
    works.add(Work())
    assert len(works) == 2
    running.completed = True
    clock.now += 60.0
    works.add(Work())
    assert len(works) == 1


def test_clear_lets_every_work_go():
    works = RecentWorks()
    for _ in range(3):
        works.add(Work(completed=False))
    works.clear()
    assert len(works) == 0


def test_threads_may_add_at_the_same_time():
    clock = Clock()
    works = RecentWorks(keep_seconds=0.0, clock=clock)

    def add_many():
        for _ in range(2000):
            clock.now += 0.001
            works.add(Work())

    threads = [threading.Thread(target=add_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(works) <= 4  # everything older and done was let go, nothing raised


def _gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
    return [n for n in names if n.startswith("pt_gloo")]


def test_the_process_group_threads_end_while_its_works_are_held():
    """What `WorkerGroup.close` relies on: dropping the last reference to a process group
    joins its worker threads even though Python still holds works of that group."""
    store = dist.HashStore()
    before = len(_gloo_threads())
    pg = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))
    works = RecentWorks()
    tensor = torch.ones(4)
    works.add(pg.allreduce([tensor])).wait()
    assert len(_gloo_threads()) > before
    del pg
    assert len(_gloo_threads()) == before
    assert len(works) == 1
    assert torch.equal(tensor, torch.ones(4))
    works.clear()


def test_pending_lists_the_works_not_completed_oldest_first():
    works = RecentWorks(clock=Clock())
    first, done, last = Work(completed=False), Work(), Work(completed=False)
    for work in (first, done, last):
        works.add(work)
    assert works.pending() == [first, last]
    first.completed = True
    assert works.pending() == [last]
