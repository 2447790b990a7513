"""A Dataset is a torch IterableDataset: DataLoader interop, and NumPy output."""

from __future__ import annotations

import numpy as np
import torch

from phalanx.data import Dataset


def test_dataloader_with_batch_size_none_yields_the_elements():
    ds = Dataset.from_tensor_slices((torch.arange(5), torch.arange(5) * 2)).batch(2)
    assert isinstance(ds, torch.utils.data.IterableDataset)
    loader = torch.utils.data.DataLoader(ds, batch_size=None)
    assert [x.tolist() for x, _ in loader] == [[0, 1], [2, 3], [4]]
    assert len(loader) == 3


def test_dataloader_can_batch_elements_itself():
    loader = torch.utils.data.DataLoader(Dataset.range(5), batch_size=2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]


def test_dataloader_workers_split_the_elements_and_keep_the_order():
    ds = Dataset.range(11).map(lambda v: v * 10).batch(2)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert [b.tolist() for b in loader] == [b.tolist() for b in ds]


def test_as_numpy_iterator_keeps_structure_and_dtype():
    ds = Dataset.from_tensor_slices({"x": np.ones((2, 3), np.float64), "name": ["a", "b"]})
    first = next(ds.as_numpy_iterator())
    assert isinstance(first["x"], np.ndarray)
    assert first["x"].dtype == np.float64
    assert first["name"] == "a"
