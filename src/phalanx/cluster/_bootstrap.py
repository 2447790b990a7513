"""Runs a launched *function* in a child process; its source is given to ``python -c``.

The parent (`phalanx.cluster._target`) passes one JSON argument:

* ``sys_path``: the parent's ``sys.path`` entries, so the function's module imports in the
  child exactly as it did in the parent (tests, notebooks-turned-scripts, src layouts);
* ``main_path``: the parent's main script when the function lives in ``__main__``; it is
  re-run as ``__mp_main__`` (as multiprocessing's spawn does), so code under
  ``if __name__ == "__main__":`` does not run again;
* either ``payload`` (base64 pickle of ``(function, args)``: the function is pickled by
  reference, i.e. module and name) or ``entry`` (``"module:function"``, called with no
  arguments and ``sys.argv = [entry, *args]``, like a console-script entry point).

This file imports nothing from phalanx: the child may not be able to import it before
``sys.path`` is set, and importing phalanx (and torch) would slow every start.
"""

from __future__ import annotations

import base64
import importlib
import json
import pickle
import runpy
import sys
import types
from typing import Any


def main(argv: list[str]) -> int:
    """Runs the function described by ``argv[0]`` (JSON) and returns its exit code."""
    spec = json.loads(argv[0])
    sys.path[:0] = [entry for entry in spec["sys_path"] if entry not in sys.path]
    if spec.get("main_path"):
        _load_main(spec["main_path"])
    if "entry" in spec:
        module_name, _, name = spec["entry"].partition(":")
        sys.argv = [spec["entry"], *argv[1:]]
        return exit_code(getattr(importlib.import_module(module_name), name)())
    function, args = pickle.loads(base64.b64decode(spec["payload"]))  # our own parent wrote these bytes
    sys.argv = [f"{function.__module__}:{function.__qualname__}", *(str(a) for a in args)]
    return exit_code(function(*args))


def exit_code(result: Any) -> int:
    """A function's result as an exit code: an int is the code, anything else (None) is 0."""
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _load_main(path: str) -> None:
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
