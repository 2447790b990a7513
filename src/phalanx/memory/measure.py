"""A process's peak resident memory, measured as a user measures it (all workers, each its own).

Linux keeps each process's high-water mark of resident memory (``VmHWM`` in
``/proc/self/status``; ``resource.getrusage(...).ru_maxrss`` is the same figure). `PeakMeter`
reads it relative to a starting point: where the kernel lets a process reset its mark (writing
``5`` to ``/proc/self/clear_refs``) the meter resets it at its start, so the growth it reports is
the peak since then minus the resident memory then; elsewhere the mark covers the process's
whole life, and the growth can only be an upper bound of it (`PeakMeter.reset_ok` says which).

`release_free_memory` hands the C allocator's free heap back to the system (glibc's
``malloc_trim``): FullyShardedStrategy calls it after each optimizer step, so that the layers
FSDP2 gathered and freed during the step do not stay counted in the process's resident memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "PeakMeter",
    "map_large_allocations",
    "peak_resident_bytes",
    "release_free_memory",
    "resident_bytes",
]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Tensors of this size and more get their own mapping, returned to the system when freed.
MMAP_THRESHOLD_BYTES = 1 << 20


def _status(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status``, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status (Linux reports it; this system does not)")


def resident_bytes() -> int:
    """This process's resident memory now (``VmRSS``), in bytes."""
    return _status("VmRSS")


def peak_resident_bytes() -> int:
    """This process's high-water mark of resident memory (``VmHWM``), in bytes."""
    return _status("VmHWM")


def _reset_peak() -> bool:
    """Resets ``VmHWM`` to the current resident memory; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class PeakMeter:
    """Peak resident memory growth of this process from the meter's creation.

    Make one just before the strategy (each worker its own); `growth` is then the worker's peak
    resident memory since, minus what it held at the start.

    Args:
        reset: Reset the process's high-water mark now (default). False keeps the mark as an
            earlier meter left it: a second meter, started later, whose `growth` counts from
            its own start the peak both meters see (the peak comes after it).
    """

    def __init__(self, reset: bool = True) -> None:
        self.reset_ok = _reset_peak() if reset else True
        self.start = resident_bytes()

    def growth(self) -> int:
        """Peak resident bytes since the start, less the resident bytes at the start."""
        return peak_resident_bytes() - self.start

    def now(self) -> int:
        """Resident bytes now, less the resident bytes at the start."""
        return resident_bytes() - self.start


@functools.cache
def _libc_function(name: str, *argtypes: type) -> Any:
    """glibc's ``name`` (returning int), or None where the C library has no such function."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        function = getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


def map_large_allocations(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Has glibc give every allocation of ``threshold`` bytes or more its own mapping, returned
    to the system as soon as it is freed (the process's own malloc setting: every thread,
    until the process ends); False (nothing changed) where the C library is not glibc.

    Why: glibc raises its mmap threshold after the first large block is freed (up to 32 MiB),
    and from then on serves large tensors from its heap, which keeps them after they are freed.
    FSDP2 gathers each layer and frees it again, several times a step: the resident memory
    would count those layers' blocks, fragmented, as if still held. A fixed threshold is what
    ``MALLOC_MMAP_THRESHOLD_`` would set from the environment; its cost is a page fault per
    4 KiB of each large allocation.
    """
    mallopt = _libc_function("mallopt", ctypes.c_int, ctypes.c_int)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold))


def release_free_memory() -> bool:
    """Returns the C heap's free memory to the system (glibc ``malloc_trim(0)``); a no-op
    (False) where the C library has no such call. Any thread may call it; it frees nothing
    that is in use."""
    trim = _libc_function("malloc_trim", ctypes.c_size_t)
    if trim is None:
        return False
    trim(0)
    return True
