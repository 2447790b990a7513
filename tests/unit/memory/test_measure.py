"""PeakMeter reads this process's resident high-water mark; the glibc helpers act or say they cannot."""

from __future__ import annotations

import ctypes
import sys

import pytest

from phalanx.memory import PeakMeter, map_large_allocations, measure, release_free_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")


def test_the_meter_sees_memory_touched_after_it_started_and_not_before():
    kept = bytearray(32 << 20)  # touched before the meter: not its growth
    meter = PeakMeter()
    if not meter.reset_ok:
        pytest.skip("this kernel does not let a process reset its VmHWM (/proc/self/clear_refs)")
    assert meter.growth() < 16 << 20
    grown = bytearray(64 << 20)  # zeroed: every page touched
    assert meter.growth() >= 60 << 20
    del grown, kept


def test_a_second_meter_counts_from_its_own_start_the_peak_both_see():
    """The benchmark's "with imports" figure: one meter before a script's imports, one after."""
    first = PeakMeter()
    if not first.reset_ok:
        pytest.skip("this kernel does not let a process reset its VmHWM (/proc/self/clear_refs)")
    # filled, not zeroed: a large zeroed allocation is mapped pages never touched, not resident
    imports = b"\x01" * (32 << 20)  # what the imports touched, between the two meters
    second = PeakMeter(reset=False)
    grown = b"\x01" * (64 << 20)
    assert 60 << 20 <= second.growth() < first.growth()
    assert first.growth() - second.growth() >= 30 << 20
    del grown, imports


def test_a_missing_field_is_named():
    with pytest.raises(RuntimeError, match="VmNothing is not in /proc/self/status"):
        measure._status("VmNothing")


def test_the_glibc_helpers_act_on_glibc_and_say_so_elsewhere(monkeypatch):
    assert release_free_memory() is (measure._libc_function("malloc_trim", ctypes.c_size_t) is not None)
    monkeypatch.setattr(measure, "_libc_function", lambda *a: None)  # a C library without them
    assert release_free_memory() is False
    assert map_large_allocations() is False
