"""Whether the workers share this machine's memory: the probe that decides if the
shared-memory transport (`phalanx.communication.transports.shm.shared_memory`) may be used, and whether
collectives need the TLS ring (`phalanx.communication.transports.choice`)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import sys
from typing import Any

from phalanx import settings

__all__ = ["SHARED_MEMORY_ENV", "probe_machines", "same_machine_pids", "shared_memory_supported"]

SHARED_MEMORY_ENV = "PHALANX_SHARED_MEMORY"
SHM_DIR = "/dev/shm"  # noqa: S108 (files are opened O_NOFOLLOW, mode 0600: a planted one fails)


def shared_memory_supported() -> bool:
    """Whether this process may use the transport: Linux on x86-64 with ``/dev/shm``, and
    ``PHALANX_SHARED_MEMORY`` not set to 0/false/off."""
    return _shared_memory_allowed() and _platform_supported()


def _shared_memory_allowed() -> bool:
    return settings.current().shared_memory


def _platform_supported() -> bool:
    machine = platform.machine().lower()
    return sys.platform.startswith("linux") and machine in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def _pid_namespace() -> str:
    """This process's PID namespace (``"pid:[4026531836]"``), or '' where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _read_probe(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def same_machine_pids(store: Any, rank: int, world_size: int, tag: str) -> list[int] | None:
    """Every worker's PID (by rank) when all of them may share memory, else None (all workers):
    `probe_machines`' PIDs when every worker allows the transport."""
    pids, allowed = probe_machines(store, rank, world_size, tag)
    return pids if allowed else None


def probe_machines(store: Any, rank: int, world_size: int, tag: str) -> tuple[list[int] | None, bool]:
    """(every worker's PID by rank when all of them are on this machine, else None; whether
    every worker allows the shared-memory transport) (all workers).

    "The same machine" is decided by what the transport needs, never by host names or boot
    ids (two containers or network namespaces can share those and still not share memory):
    every worker writes a random probe file into its ``/dev/shm`` and publishes its name and
    content in ``store``; a worker that reads every other's probe shares their ``/dev/shm``.
    The workers must also share a PID namespace (peers are watched by PID). Each worker
    publishes what it saw, so every worker reaches the same answer. Blocks until every worker
    published (the store's timeout). ``PHALANX_SHARED_MEMORY=0`` on any worker switches the
    transport off, not the answer (which also decides whether collectives need TLS).

    Args:
        store: The job's rendezvous store.
        rank, world_size: This worker and the number of workers.
        tag: Unique to this job (names the probe files and store keys).
    """
    probe = os.path.join(SHM_DIR, f"phalanx-probe-{tag}-{rank}-{secrets.token_hex(4)}")
    content = secrets.token_hex(16)
    ok = _platform_supported()
    try:
        if ok:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(content)
        me = {
            "ok": ok,
            "allowed": _shared_memory_allowed(),
            "probe": probe,
            "content": content,
            "pidns": _pid_namespace(),
            "pid": os.getpid(),
        }
        store.set(f"machine/{rank}", json.dumps(me))
        everyone = [json.loads(v) for v in store.multi_get([f"machine/{r}" for r in range(world_size)])]
        sees = all(
            e["ok"] and e["pidns"] == me["pidns"] and _read_probe(e["probe"]) == e["content"]
            for e in everyone
        )
        store.set(f"machine-shared/{rank}", "1" if ok and sees else "0")
        verdicts = store.multi_get([f"machine-shared/{r}" for r in range(world_size)])
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    allowed = all(e.get("allowed", True) for e in everyone)
    return ([int(e["pid"]) for e in everyone] if all(v == b"1" for v in verdicts) else None), allowed
