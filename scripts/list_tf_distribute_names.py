"""Lists TensorFlow's public tf.distribute surface, once, into tests/unit/tf_surface/.

Run in the optional TensorFlow environment (not phalanx's: phalanx never imports TensorFlow):

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu==2.21.0
    /tmp/tfvenv/bin/python scripts/list_tf_distribute_names.py

It walks ``tf.distribute`` (every module, class, function and class member) plus the classes
tf.distribute programs use from elsewhere (``tf.train.Checkpoint``, ``CheckpointManager``,
``CheckpointOptions``, ``ClusterSpec``, ``tf.data.experimental.AutoShardPolicy``), and writes
the names, with those left out and why, to ``tests/unit/tf_surface/tf_distribute_2_21.json``.
tests/unit/tf_surface/test_tf_surface.py checks phalanx against that file.

Left out: TPU and Google Compute Engine names; members TensorFlow's own API docs hide as
TF1-only (hidden from TF 2's docs but documented in ``tf.compat.v1``: ``experimental_run``,
``make_dataset_iterator``, ...);
members inherited from Python's builtins (``int.bit_length``, ``tuple.count``, ...).
"""

from __future__ import annotations

import enum
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parents[1] / "tests" / "unit" / "tf_surface" / "tf_distribute_2_21.json"
EXTRA_CLASSES = (
    "tf.train.Checkpoint",
    "tf.train.CheckpointManager",
    "tf.train.CheckpointOptions",
    "tf.train.ClusterSpec",
    "tf.data.experimental.AutoShardPolicy",
)
GCE = ("GCEClusterResolver",)


def _resolve(tf: Any, dotted: str) -> Any:
    value = tf
    for part in dotted.split(".")[1:]:
        value = getattr(value, part)
    return value


def _hidden(value: Any) -> bool:
    """Whether TensorFlow's API docs hide this member (doc_controls.do_not_generate_docs)."""
    target = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    return hasattr(target, "_tf_docs_do_not_document")  # the marker's value is None


def _v1_class(tf: Any, path: str, cls: type | None) -> type | None:
    """The tf.compat.v1.distribute class of the same name (any strategy falls back to Strategy)."""
    value: Any = tf.compat.v1.distribute
    for part in path.split(".")[2:]:
        value = getattr(value, part, None)
    if inspect.isclass(value):
        return value
    if cls is not None and issubclass(cls, tf.distribute.Strategy):
        return tf.compat.v1.distribute.Strategy
    return None


def _exclusion(tf: Any, path: str, value: Any, cls: type | None = None) -> str | None:
    """Why a name is left out of the surface, or None when it is part of it.

    A member TF 2's docs hide but tf.compat.v1's class of that name documents is TF1-only
    (``Strategy.experimental_run``); one hidden in both (``DistributedDataset.reduce``) stays.
    """
    if "TPU" in path or "tpu" in path.rsplit(".", 1)[-1]:
        return "TPU"
    if any(name in path for name in GCE):
        return "Google Compute Engine"
    if cls is not None and _hidden(value):
        owner_path, member = path.rsplit(".", 1)
        v1 = _v1_class(tf, owner_path, cls)
        if v1 is not None and hasattr(v1, member) and not _hidden(inspect.getattr_static(v1, member)):
            return "TF1-only (hidden from TF 2's API docs, documented in tf.compat.v1)"
    return None


def _defining_class(cls: type, name: str) -> type:
    return next(klass for klass in cls.__mro__ if name in vars(klass))


def _members(tf: Any, cls: type, path: str, names: list[str], excluded: dict[str, str]) -> None:
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = _defining_class(cls, name)
        if owner.__module__ == "builtins" or owner in (enum.Enum, enum.IntEnum):
            continue
        member_path = f"{path}.{name}"
        reason = _exclusion(tf, member_path, inspect.getattr_static(cls, name), cls)
        if reason:
            excluded[member_path] = reason
        else:
            names.append(member_path)


def _walk(tf: Any, module: types.ModuleType, path: str, names: list[str], excluded: dict[str, str]) -> None:
    for name in sorted(dir(module)):
        if name.startswith("_"):
            continue
        value = getattr(module, name)
        child = f"{path}.{name}"
        reason = _exclusion(tf, child, value)
        if reason:
            excluded[child] = reason
            continue
        names.append(child)
        if isinstance(value, types.ModuleType):
            _walk(tf, value, child, names, excluded)
        elif inspect.isclass(value):
            _members(tf, value, child, names, excluded)


def main() -> int:
    """Writes the JSON file; returns the exit status."""
    import tensorflow as tf

    names: list[str] = []
    excluded: dict[str, str] = {}
    _walk(tf, tf.distribute, "tf.distribute", names, excluded)
    for dotted in EXTRA_CLASSES:
        names.append(dotted)
        _members(tf, _resolve(tf, dotted), dotted, names, excluded)
    document = {
        "tensorflow_version": tf.__version__,
        "generated_by": "scripts/list_tf_distribute_names.py",
        "names": names,
        "excluded": dict(sorted(excluded.items())),
    }
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{len(names)} names, {len(excluded)} left out -> {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
