"""What each task runs: the command line for a script, ``"module:function"`` or a function."""

from __future__ import annotations

import base64
import importlib.util
import inspect
import json
import os
import pickle
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from phalanx.cluster import _bootstrap

__all__ = ["Target", "build_command"]

Target = str | os.PathLike[str] | Callable[..., Any]
_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def build_command(target: Target, args: Sequence[Any], python: str) -> list[str]:
    """The argv that runs ``target`` in a new process.

    * a script path: ``python -u script *args``;
    * ``"module:function"`` (not an existing file): the function is imported in the child and
      called with no arguments, ``sys.argv = ["module:function", *args]`` (console-script
      convention); its int result is the exit code;
    * a function: pickled by reference with ``args`` (any picklable values) and called as
      ``function(*args)`` in the child; its int result is the exit code. It must be a
      module-level function of an importable module, or of the main script.

    Raises:
        ValueError: The script does not exist, the module is not importable, or the function
            cannot be found by name in a new process (a lambda, a nested function, or one
            defined interactively).
    """
    if callable(target):
        return _bootstrap_command(python, _function_spec(target, args), [])
    path = os.fspath(target)
    if os.path.isfile(path):
        return [python, "-u", path, *map(str, args)]
    if _ENTRY.match(path):
        _check_importable(path)
        return _bootstrap_command(python, {"entry": path}, [str(a) for a in args])
    raise ValueError(
        f"launch target must be an existing script, 'module:function' or a function. Received: {path!r} "
        f"(no such file in {os.getcwd()}). HINT: check the path, or write 'package.module:function'."
    )


def _bootstrap_command(python: str, spec: dict[str, Any], argv: list[str]) -> list[str]:
    spec = {"sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path], **spec}
    return [python, "-u", "-c", inspect.getsource(_bootstrap), json.dumps(spec), *argv]


def _function_spec(function: Callable[..., Any], args: Sequence[Any]) -> dict[str, Any]:
    name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"
    try:
        payload = pickle.dumps((function, tuple(args)))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(
            "launch runs a function in new processes, so it must be a module-level function that can be "
            f"imported by name, with picklable args. Received: {name} ({exc}). HINT: define it at the top "
            "level of a module (not a lambda or a nested function), or pass a script path."
        ) from None
    spec: dict[str, Any] = {"payload": base64.b64encode(payload).decode()}
    if function.__module__ == "__main__":
        main_path = getattr(sys.modules["__main__"], "__file__", None)
        if main_path is None:
            raise ValueError(
                f"launch cannot run {name}: it was defined in an interactive session, which a new process "
                "cannot import. HINT: put the function in a .py file and import it from there."
            )
        spec["main_path"] = os.path.abspath(main_path)
    return spec


def _check_importable(entry: str) -> None:
    module = entry.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(
            f"launch target {entry!r}: module {module!r} cannot be imported. "
            "HINT: install the package, set PYTHONPATH, or pass a script path."
        )
