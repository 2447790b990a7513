"""``Strategy.make_experimental_numpy_dataset``: a `phalanx.data.Dataset` of NumPy arrays' rows.

TF copies the arrays once to each worker's host CPU instead of embedding them as graph
constants. phalanx has no graph: the rows stay where NumPy put them, shared with the returned
dataset's tensors (no copy), and `Strategy.experimental_distribute_dataset` splits the batches
the user makes of them across the replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from phalanx.data.dataset import Dataset

__all__ = ["make_numpy_dataset"]


def _check_leaves(value: Any, path: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _check_leaves(item, f"{path}[{index}]")
    elif not isinstance(value, np.ndarray) or value.ndim == 0:
        raise ValueError(
            "make_experimental_numpy_dataset takes NumPy arrays of rank >= 1, or tuples, lists or dicts "
            f"of them. Received: {path} = {type(value).__name__}"
            f"{' of rank 0' if isinstance(value, np.ndarray) else ''}. HINT: for tensors or other "
            "values use phalanx.data.Dataset.from_tensor_slices."
        )


def make_numpy_dataset(numpy_input: Any) -> Dataset:
    """A dataset with one element per row of ``numpy_input`` (tf's make_experimental_numpy_dataset).

    Batch it (``.batch(global_batch_size)``) and give it to
    ``strategy.experimental_distribute_dataset`` to split each batch across the replicas.

    Args:
        numpy_input: A NumPy array, or a tuple, list or dict of arrays with the same number of
            rows.

    Returns:
        A `phalanx.data.Dataset` whose tensors share the arrays' memory and dtypes.

    Raises:
        ValueError: A leaf is not a NumPy array of rank >= 1, or the row counts differ.
    """
    _check_leaves(numpy_input, "numpy_input")
    return Dataset.from_tensor_slices(numpy_input)
