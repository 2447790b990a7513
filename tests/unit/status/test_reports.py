"""What a task reports: its rates over the window (fake clocks, no processes)."""

from __future__ import annotations

import pytest

from phalanx.status.counters import Counters
from phalanx.status.reports import Reporter, resident_memory


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_report_measures_rates_over_the_window():
    clock, counters = Clock(), Counters()
    reporter = Reporter("worker:1", "127.0.0.1:1", None, lambda: 3, counters, clock)
    first = reporter.report()
    assert first["steps_per_second"] is None  # no window yet
    assert first["collective_wait_fraction"] is None
    for _ in range(4):
        counters.stepped()
    counters.waited(1.5)
    clock.now += 2.0
    report = reporter.report()
    assert report["steps_per_second"] == pytest.approx(2.0)
    assert report["collective_wait_fraction"] == pytest.approx(0.75)
    assert report["step"] == 4
    assert report["membership_epoch"] == 3
    assert report["state"] == "joining"
    assert report["resident_memory_bytes"] > 0


def test_the_window_slides():
    clock, counters = Clock(), Counters()
    reporter = Reporter("worker:0", "127.0.0.1:1", None, counters=counters, clock=clock)
    for _ in range(30):  # 15 s of reports, waiting all the time
        counters.waited(0.5)
        clock.now += 0.5
        reporter.report()
    for _ in range(20):  # then 10 s without waiting: the old waits fall out of the window
        clock.now += 0.5
        last = reporter.report()
    assert last["collective_wait_fraction"] == pytest.approx(0.0)


def test_closures_per_second_on_a_parameter_server_chief():
    clock, counters = Clock(), Counters()
    reporter = Reporter("chief:0", "127.0.0.1:1", None, counters=counters, clock=clock)
    reporter.report()
    counters.closure("worker:0", done=6)
    counters.closure("worker:1", done=2, lost=1, rescheduled=1)
    clock.now += 2.0
    closures = reporter.report()["closures"]
    assert closures["worker:0"] == {"done": 6, "lost": 0, "rescheduled": 0, "per_second": 3.0}
    assert closures["worker:1"]["per_second"] == 1.0


def test_resident_memory_is_the_process_size():
    assert 10 * 2**20 < resident_memory() < 2**40
