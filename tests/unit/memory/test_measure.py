"""PeakMeter reads this process's resident high-water mark; the glibc helpers act or say they cannot."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest

from phalanx.memory import PeakMeter, map_large_allocations, measure, release_free_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")


def _fresh_pages(nbytes: int) -> mmap.mmap:
    """nbytes of new resident memory: a mapping of its own, every page written. (A Python
    object of that size may come from glibc's heap, from pages an earlier test freed and the
    heap kept resident, and then grows nothing.)"""
    pages = mmap.mmap(-1, nbytes)
    page = b"\x01" * mmap.PAGESIZE
    for _ in range(nbytes // mmap.PAGESIZE):
        pages.write(page)
    return pages


def test_the_meter_sees_memory_touched_after_it_started_and_not_before():
    kept = _fresh_pages(32 << 20)  # touched before the meter: not its growth
    meter = PeakMeter()
    if not meter.reset_ok:
        pytest.skip("this kernel does not let a process reset its VmHWM (/proc/self/clear_refs)")
    assert meter.growth() < 16 << 20
    grown = _fresh_pages(64 << 20)
    assert meter.growth() >= 60 << 20
    grown.close()
    kept.close()


def test_a_second_meter_counts_from_its_own_start_the_peak_both_see():
    """The benchmark's "with imports" figure: one meter before a script's imports, one after."""
    first = PeakMeter()
    if not first.reset_ok:
        pytest.skip("this kernel does not let a process reset its VmHWM (/proc/self/clear_refs)")
    imports = _fresh_pages(32 << 20)  # what the imports touched, between the two meters
    second = PeakMeter(reset=False)
    grown = _fresh_pages(64 << 20)
    assert 60 << 20 <= second.growth() < first.growth()
    assert first.growth() - second.growth() >= 30 << 20
    grown.close()
    imports.close()


def test_a_missing_field_is_named():
    with pytest.raises(RuntimeError, match="VmNothing is not in /proc/self/status"):
        measure._status("VmNothing")


def test_the_glibc_helpers_act_on_glibc_and_say_so_elsewhere(monkeypatch):
    assert release_free_memory() is (measure._libc_function("malloc_trim", ctypes.c_size_t) is not None)
    monkeypatch.setattr(measure, "_libc_function", lambda *a: None)  # a C library without them
    assert release_free_memory() is False
    assert map_large_allocations() is False
