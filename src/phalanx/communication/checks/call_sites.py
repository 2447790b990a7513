"""Where a collective was called from, in the user's words: ``"optimizer.step at train.py:67"``.

Used by the stall inspector (`phalanx.communication.checks.stall_inspector`) and the replicas'
meeting points to name the call site of each collective. The walk goes out from the caller's
frame over the frames of phalanx, torch and the standard library (``sys._getframe`` and
``f_back``: no source is read, nothing is formatted until a frame outside them is found), so
it costs a few microseconds and runs once per collective, never per tensor.

The label before "at" is the library entry point the user's line called: the outermost
phalanx or torch frame on the way (``Model.fit``, ``strategy.reduce``, ``optimizer.step``,
``loss.backward``), so a collective issued deep inside phalanx still names what the user wrote.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from types import CodeType, FrameType

import torch

__all__ = ["call_site"]


def _folder(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)), "")


_PHALANX = _folder(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # src/phalanx/
_TORCH = _folder(torch.__file__)
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
_SITE = ("site-packages", "dist-packages")

# What the user wrote, for entry points whose own names say it badly.
_TORCH_ENTRIES = {"Tensor.backward": "loss.backward", "backward": "torch.autograd.backward"}
_PHALANX_ENTRIES = {"_before_step": "optimizer.step", "_after_step": "optimizer.step"}
# torch's decorators around its entry points (``dist.all_reduce`` runs inside
# ``c10d_logger._exception_logger``'s wrapper): the frame inside names the call
_WRAPPERS = frozenset({"_exception_logger", "wrapper", "decorate_context", "_fn", "inner"})


@functools.lru_cache(maxsize=4096)  # a walk asks for ~10 frames per collective
def _is_library(filename: str) -> bool:
    """Frames the walk passes over: phalanx, torch and the standard library (not site-packages,
    where a user's own package may live)."""
    if filename.startswith((_PHALANX, _TORCH)):
        return True
    return filename.startswith(_STDLIB) and not any(s in filename for s in _SITE)


@functools.lru_cache(maxsize=4096)  # the same few sites issue a training loop's collectives
def _site(entry: CodeType | None, code: CodeType, line: int) -> str:
    label = _entry_label(entry)
    where = f"{os.path.basename(code.co_filename)}:{line}"
    return f"{label} at {where}" if label else where


def _entry_label(code: CodeType | None) -> str:
    """The name of the library function the user's line called (``""`` if none)."""
    if code is None:
        return ""
    name: str = getattr(code, "co_qualname", code.co_name)  # Python 3.11+; 3.10: the bare name
    if code.co_filename.startswith(_TORCH):
        if "/optim/" in code.co_filename.replace(os.sep, "/"):
            return "optimizer.step"
        return _TORCH_ENTRIES.get(name, name.split(".<locals>")[0])
    if not code.co_filename.startswith(_PHALANX):
        return ""  # the standard library (a thread's bootstrap)
    name = _PHALANX_ENTRIES.get(name, name.split(".<locals>")[0])
    owner, dot, method = name.partition(".")
    if dot and owner.endswith("Strategy"):
        return f"strategy.{method}"  # what the user typed: strategy.reduce, strategy.run
    return name


def call_site(frame: FrameType | None = None) -> str:
    """``"<entry point> at <file>:<line>"`` for the first frame outside the libraries.

    Args:
        frame: Where to start the walk (default: the caller's caller).

    Returns:
        E.g. ``"optimizer.step at train.py:67"``, ``"Model.fit at train.py:80"``, or only the
        entry point (``"loss.backward"``) when no user frame is on this thread's stack (a
        backward pass on an autograd device thread), or ``"?"``.
    """
    here: FrameType | None = frame if frame is not None else sys._getframe(2)
    entry: CodeType | None = None
    while here is not None:
        code = here.f_code
        if not _is_library(code.co_filename):
            return _site(entry, code, here.f_lineno)
        if code.co_name not in _WRAPPERS:  # a decorator's frame says nothing of what was called
            entry = code
        here = here.f_back
    return _entry_label(entry) or "?"
