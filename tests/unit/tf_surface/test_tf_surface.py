"""TensorFlow 2.21's tf.distribute surface, name by name, exists in phalanx.

The names come from ``tf_distribute_2_21.json``, written once by
scripts/list_tf_distribute_names.py in a TensorFlow environment. A listed name that phalanx
lacks fails the test; the coverage is printed (``pytest -s``) and must stay at least 97%.
Names that cannot mean anything on PyTorch exist and raise an error that says so and what to
use instead: test_refusals.py checks each.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

SURFACE = json.loads((Path(__file__).parent / "tf_distribute_2_21.json").read_text())

# TF path prefix -> phalanx path prefix, longest first.
PREFIXES = (
    ("tf.distribute.experimental.coordinator", "phalanx.experimental.coordinator"),
    ("tf.distribute.experimental.partitioners", "phalanx.experimental.partitioners"),
    ("tf.distribute.experimental.rpc", "phalanx.experimental.rpc"),
    ("tf.distribute.experimental", "phalanx.experimental"),
    ("tf.distribute.cluster_resolver", "phalanx.cluster_resolver"),
    ("tf.distribute.coordinator", "phalanx.coordinator"),
    ("tf.distribute", "phalanx"),
    ("tf.train.ClusterSpec", "phalanx.cluster.ClusterSpec"),
    ("tf.train", "phalanx.checkpoint"),
    ("tf.data.experimental", "phalanx.data.experimental"),
)


def phalanx_path(tf_path: str) -> str:
    """The phalanx spelling of a TF name."""
    for tf_prefix, ours in PREFIXES:
        if tf_path == tf_prefix or tf_path.startswith(tf_prefix + "."):
            return ours + tf_path[len(tf_prefix) :]
    raise AssertionError(f"no phalanx prefix for {tf_path}")


def _has_member(owner: type, name: str) -> bool:
    """Attributes, properties, dataclass fields, and instance attributes the class declares
    (annotated in its body, as ``Checkpoint.save_counter``)."""
    if hasattr(owner, name):
        return True
    if dataclasses.is_dataclass(owner) and name in {field.name for field in dataclasses.fields(owner)}:
        return True
    return any(name in inspect.get_annotations(klass) for klass in owner.__mro__)


def resolve(path: str) -> Any:
    """The object a dotted phalanx path names; AttributeError when it does not exist."""
    parts = path.split(".")
    value: Any = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        if isinstance(value, type) and index == len(parts) - 1:
            if not _has_member(value, part):
                raise AttributeError(f"{'.'.join(parts[:index])} has no member {part!r}")
            return getattr(value, part, None)
        value = getattr(value, part)
    return value


def missing_names() -> list[str]:
    """Listed TF names phalanx does not have."""
    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # deprecated names warn, and exist
        for tf_path in SURFACE["names"]:
            try:
                resolve(phalanx_path(tf_path))
            except AttributeError:
                missing.append(tf_path)
    return missing


def test_the_list_is_tensorflow_2_21_and_is_large():
    assert SURFACE["tensorflow_version"].startswith("2.21")
    assert len(SURFACE["names"]) > 300
    assert "tf.distribute.MirroredStrategy.run" in SURFACE["names"]
    assert "tf.distribute.MirroredStrategy.experimental_run" in SURFACE["excluded"]


def test_every_listed_tensorflow_name_exists_in_phalanx():
    missing = missing_names()
    names = SURFACE["names"]
    coverage = 1 - len(missing) / len(names)
    print(f"\nTF 2.21 tf.distribute surface: {len(names) - len(missing)}/{len(names)} ({coverage:.1%})")
    assert coverage >= 0.97, missing
    assert not missing, f"{len(missing)} TF names missing in phalanx: {missing}"


# Names that cannot mean anything on PyTorch: they exist and raise NotImplementedError saying
# so and what to use instead (docs/migration.md states how many).
REFUSED = sorted(name for name in SURFACE["names"] if name.endswith(".configure"))
MIGRATION = Path(__file__).resolve().parents[3] / "docs" / "migration.md"


def test_refused_names_raise_and_name_what_to_use(one_device):
    assert len(REFUSED) == 8
    for tf_path in REFUSED:
        configure = resolve(phalanx_path(tf_path))
        with pytest.raises(NotImplementedError, match="HINT"):
            configure(one_device)


def test_the_migration_guide_states_the_coverage_and_the_refusals():
    text = MIGRATION.read_text()
    total = len(SURFACE["names"])
    assert f"all {total} names" in text
    assert f"{len(REFUSED)} of them raise" in text


@pytest.mark.parametrize(
    ("tf_path", "ours"),
    [
        ("tf.distribute.MirroredStrategy.run", "phalanx.MirroredStrategy.run"),
        (
            "tf.distribute.experimental.coordinator.RemoteValue",
            "phalanx.experimental.coordinator.RemoteValue",
        ),
        ("tf.train.ClusterSpec.as_dict", "phalanx.cluster.ClusterSpec.as_dict"),
        ("tf.train.CheckpointManager", "phalanx.checkpoint.CheckpointManager"),
        ("tf.data.experimental.AutoShardPolicy.DATA", "phalanx.data.experimental.AutoShardPolicy.DATA"),
    ],
)
def test_tf_names_map_to_phalanx_spellings(tf_path, ours):
    assert phalanx_path(tf_path) == ours


def test_a_missing_name_is_reported():
    with pytest.raises(AttributeError, match="no member 'no_such_member'"):
        resolve("phalanx.Strategy.no_such_member")
    with pytest.raises(AttributeError):
        resolve("phalanx.NoSuchThing")
