"""What fit/evaluate/predict accept as data, turned into epochs of global batches.

Arrays (NumPy of any numeric dtype, tensors, nested Python lists of numbers, or
tuples/lists/dicts of them) are batched here with the *global* batch size and shuffled with a
seed per epoch, so every worker sees the same order and an interrupted epoch can be replayed
exactly. Anything else (a DataLoader, a `phalanx.data.Dataset`, an iterable of batches)
already yields global batches.

Keras' floatx rule: floating inputs, targets and sample weights are cast to the model's
floating parameter dtype (``float_dtype_of``), so ``fit(np.ones((100, 1)), ...)`` (float64)
trains a float32 model. Integer arrays (token ids, class labels) become int64, torch's index
dtype (``nn.Embedding`` and ``cross_entropy`` targets take no other); bool arrays stay bool.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from phalanx.input.splitting import batch_size_of, slice_batch

__all__ = ["DataHandler", "float_dtype_of", "pack_batch", "split_validation", "unpack_batch"]

DEFAULT_BATCH_SIZE = 32


def float_dtype_of(module: torch.nn.Module) -> torch.dtype:
    """The dtype floating inputs are cast to: the module's first floating parameter's (or
    buffer's), else torch's default dtype (Keras' ``floatx``)."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.get_default_dtype()


def _is_array_like(x: Any) -> bool:
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return True
    if isinstance(x, (tuple, list)) and x and all(_is_array_like(v) for v in x):
        return True
    if isinstance(x, list) and x and _is_numbers(x):
        return True  # [[1.0, 2.0], [3.0, 4.0]]: one array, as np.asarray reads it
    return isinstance(x, dict) and bool(x) and all(_is_array_like(v) for v in x.values())


def _is_numbers(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return bool(x) and all(_is_numbers(v) for v in x)
    return isinstance(x, (bool, int, float, np.number, np.bool_))


def _to_tensors(structure: Any, float_dtype: torch.dtype | None) -> Any:
    """NumPy arrays and lists of numbers as tensors, floating ones cast to ``float_dtype``
    (None: kept), integer ones int64 (torch's index dtype; uint64 beyond int64 wraps).

    Raises:
        TypeError: An array of strings or objects.
    """
    if isinstance(structure, list) and structure and _is_numbers(structure):
        structure = np.asarray(structure)
    if isinstance(structure, np.ndarray):
        if structure.dtype.kind not in "biuf":
            raise TypeError(
                "fit/evaluate/predict take numeric arrays (bool, integer or floating). Received: "
                f"an array of dtype {structure.dtype}. HINT: encode strings or objects as numbers "
                "first, or pass a phalanx.data.Dataset that yields tensors."
            )
        if structure.dtype.kind in "iu" and structure.dtype != np.int64:
            structure = structure.astype(np.int64)
        structure = torch.from_numpy(structure)
    if isinstance(structure, torch.Tensor):
        if float_dtype is not None and structure.is_floating_point() and structure.dtype != float_dtype:
            return structure.to(float_dtype)
        return structure
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(_to_tensors(v, float_dtype) for v in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(_to_tensors(v, float_dtype) for v in structure)
    if isinstance(structure, dict):
        return type(structure)((k, _to_tensors(v, float_dtype)) for k, v in structure.items())
    return structure


def unpack_batch(batch: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) from a batch given as x, (x,), (x, y) or (x, y, sample_weight)."""
    if isinstance(batch, tuple) and not hasattr(batch, "_fields"):
        if len(batch) == 1:
            return batch[0], None, None
        if len(batch) == 2:
            return batch[0], batch[1], None
        if len(batch) == 3:
            return batch
        raise ValueError(
            f"A batch must be x, (x, y) or (x, y, sample_weight). Received a tuple of {len(batch)} elements."
        )
    if isinstance(batch, list) and len(batch) in (2, 3):
        return unpack_batch(tuple(batch))
    return batch, None, None


def pack_batch(x: Any, y: Any = None, sample_weight: Any = None) -> tuple[Any, ...]:
    """The batch as the steps receive it (Keras' ``data``): ``(x,)``, ``(x, y)`` or
    ``(x, y, sample_weight)``, without the trailing Nones; `unpack_batch` reverses it."""
    if sample_weight is not None:
        return x, y, sample_weight
    return (x,) if y is None else (x, y)


def split_validation(x: Any, y: Any, sample_weight: Any, fraction: float) -> tuple[Any, Any]:
    """Keras' validation_split: the *last* fraction of the arrays, taken before shuffling.

    Raises:
        ValueError: The fraction is outside [0, 1) or the data are not arrays.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation_split must be in [0, 1). Received: {fraction}.")
    if not _is_array_like(x):
        raise ValueError(
            "validation_split needs NumPy arrays or tensors as x. Received: "
            f"{type(x).__name__}. HINT: pass validation_data instead."
        )
    data = _to_tensors((x, y, sample_weight), None)
    total = batch_size_of(data)
    cut = int(total * (1.0 - fraction))
    train = slice_batch(data, 0, cut)
    val = slice_batch(data, cut, total - cut)
    return train, val


class _ArrayEpochs:
    def __init__(
        self, data: Any, batch_size: int, shuffle: bool, seed: int, float_dtype: torch.dtype | None
    ) -> None:
        self._data = _to_tensors(data, float_dtype)  # cast once, not at every batch
        self._size = batch_size_of(self._data)
        self._batch = batch_size
        self._shuffle = shuffle
        self._seed = seed

    @property
    def steps(self) -> int:
        return -(-self._size // self._batch)

    def batches(self, epoch: int) -> Iterator[Any]:
        data = self._data
        if self._shuffle:
            generator = torch.Generator().manual_seed(self._seed + epoch)
            order = torch.randperm(self._size, generator=generator)
            data = _take(data, order)
        for start in range(0, self._size, self._batch):
            yield slice_batch(data, start, min(self._batch, self._size - start))


def _take(structure: Any, order: torch.Tensor) -> Any:
    if isinstance(structure, torch.Tensor):
        return structure.index_select(0, order.to(structure.device))
    if isinstance(structure, tuple):
        return tuple(_take(v, order) for v in structure)
    if isinstance(structure, list):
        return [_take(v, order) for v in structure]
    if isinstance(structure, dict):
        return {k: _take(v, order) for k, v in structure.items()}
    return structure


class DataHandler:
    """Epochs of global batches ``(x, y, sample_weight)`` for the training loops.

    Args:
        x: Arrays (with ``y``), or a DataLoader / `phalanx.data.Dataset` / iterable of batches.
        y: Targets, with array ``x`` only.
        sample_weight: Per-example weights, with array ``x`` only.
        batch_size: The *global* batch size for arrays (default 32); not allowed otherwise.
        shuffle: Shuffle arrays each epoch (seeded per epoch: the same order on every worker).
        steps_per_epoch: Steps per epoch; required for infinite datasets. With it, a dataset's
            iterator carries over from one epoch to the next, as in Keras.
        seed: The base of the per-epoch shuffling seed.
        float_dtype: What floating arrays and batches are cast to (`float_dtype_of` the
            model); None keeps their dtype.

    Raises:
        ValueError: Inconsistent arguments (see messages).
        TypeError: Arrays of strings or objects.
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        batch_size: int | None = None,
        shuffle: bool = False,
        steps_per_epoch: int | None = None,
        seed: int = 0,
        float_dtype: torch.dtype | None = None,
    ) -> None:
        if x is None:
            raise ValueError("No data: x is None. HINT: pass arrays or a dataset as x.")
        if steps_per_epoch is not None and steps_per_epoch <= 0:
            raise ValueError(f"steps_per_epoch must be positive. Received: {steps_per_epoch}.")
        self._steps_per_epoch = steps_per_epoch
        self._iterator: Iterator[Any] | None = None
        self._float_dtype = float_dtype
        if _is_array_like(x):
            if batch_size is not None and batch_size <= 0:
                raise ValueError(f"batch_size must be positive. Received: {batch_size}.")
            self._arrays: _ArrayEpochs | None = _ArrayEpochs(
                (x, y, sample_weight), batch_size or DEFAULT_BATCH_SIZE, shuffle, seed, float_dtype
            )
            self._source: Iterable[Any] | None = None
            return
        if y is not None or sample_weight is not None:
            raise ValueError(
                "y and sample_weight are only accepted with array inputs; a dataset must "
                f"yield (x, y[, sample_weight]) itself. Received x of type {type(x).__name__}."
            )
        if batch_size is not None:
            raise ValueError(
                "batch_size is only accepted with array inputs; a dataset is already batched "
                "(with the global batch size). Received: batch_size={batch_size}."
            )
        if not hasattr(x, "__iter__"):
            raise ValueError(f"Unsupported data of type {type(x).__name__}: pass arrays or a dataset.")
        self._arrays, self._source = None, x

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps in one epoch when known (for progress bars), else None."""
        if self._steps_per_epoch is not None:
            return self._steps_per_epoch
        if self._arrays is not None:
            return self._arrays.steps
        try:
            return len(self._source)  # type: ignore[arg-type]
        except TypeError:
            return None

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[tuple[Any, Any, Any]]:
        """The global batches of one epoch, after skipping ``skip`` (a resumed epoch)."""
        batches = self._raw_epoch(epoch)
        if self._steps_per_epoch is not None:
            batches = itertools.islice(batches, self._steps_per_epoch)
        if self._arrays is not None:  # cast once when the handler was made: slices of tensors
            yield from (unpack_batch(batch) for batch in itertools.islice(batches, skip, None))
            return
        for batch in itertools.islice(batches, skip, None):
            yield unpack_batch(_to_tensors(batch, self._float_dtype))

    def _raw_epoch(self, epoch: int) -> Iterator[Any]:
        if self._arrays is not None:
            return self._arrays.batches(epoch)
        assert self._source is not None
        if self._steps_per_epoch is None:
            return iter(self._source)
        return self._continuing()

    def _continuing(self) -> Iterator[Any]:
        # With steps_per_epoch the iterator carries over epochs; restart it when exhausted.
        assert self._source is not None
        restarted = False
        while True:
            if self._iterator is None:
                self._iterator = iter(self._source)
            try:
                yield next(self._iterator)
                restarted = False
            except StopIteration:
                if restarted:
                    return
                self._iterator, restarted = None, True
