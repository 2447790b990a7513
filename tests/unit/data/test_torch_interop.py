"""A Dataset is a torch IterableDataset: DataLoader interop, and NumPy output."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
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


class CallCounter:
    """Counts calls across DataLoader worker processes (a shared-memory integer, inherited by fork)."""

    def __init__(self):
        self.value = multiprocessing.get_context("fork").Value("i", 0)

    def __call__(self, x):
        with self.value.get_lock():
            self.value.value += 1
        return x * 10


def _loaded(ds, workers):
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None
    )
    return [b.tolist() for b in loader]


PIPELINES = {
    "map": lambda f: Dataset.range(23).map(f),
    "map_batch": lambda f: Dataset.range(23).map(f).batch(4),
    "map_batch_drop_map": lambda f: (
        Dataset.range(23).map(f).batch(4, drop_remainder=True).map(lambda b: b + 1)
    ),
    "map_batch_batch": lambda f: Dataset.range(23).map(f).batch(2, drop_remainder=True).batch(3),
    "shuffle_map_prefetch": lambda f: (
        Dataset.range(23).shuffle(23, seed=3).map(f, num_parallel_calls=2).prefetch(2)
    ),
    "slices_map_batch": lambda f: Dataset.from_tensor_slices(torch.arange(23)).map(f).batch(5),
}


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_dataloader_workers_map_each_element_once_in_all_and_keep_the_order(name, workers):
    want = _loaded(PIPELINES[name](lambda x: x * 10), 0)
    counter = CallCounter()
    got = _loaded(PIPELINES[name](counter), workers)
    assert got == want
    assert counter.value.value == 23  # before: 23 per worker


@pytest.mark.parametrize(
    "made",
    [
        # filter changes which elements follow which: the share is taken after it, in order
        lambda: Dataset.range(23).map(lambda x: x * 10).filter(lambda x: x % 3 != 0).batch(2),
        lambda: Dataset.range(23).map(lambda x: x * 10).filter(lambda x: x % 3 != 0),
        lambda: Dataset.range(23).shuffle(23, seed=0, reshuffle_each_iteration=False),
        lambda: Dataset.range(23),
        lambda: Dataset.from_tensor_slices(torch.arange(23)),
    ],
    ids=["filter_batch", "filter_last", "shuffle_last", "range", "tensor_slices"],
)
def test_dataloader_workers_split_any_chain_in_order(made):
    assert _loaded(made(), 2) == _loaded(made(), 0)


def test_a_block_shard_counts_its_elements():
    ds = Dataset.range(23).batch(4)
    shares = [ds.worker_share(3, i) for i in range(3)]
    assert [s.cardinality() for s in shares] == [len(list(s)) for s in shares] == [2, 2, 2]
    assert [b.tolist() for b in shares[2]] == [[8, 9, 10, 11], [20, 21, 22]]


def test_a_worker_s_share_of_tensor_slices_reads_only_its_rows(monkeypatch):
    from phalanx.data import structure

    reads = []
    index = structure.index
    monkeypatch.setattr(structure, "index", lambda data, i: reads.append(i) or index(data, i))

    def made():  # a fresh pipeline: each is at its first epoch, as in a fresh DataLoader worker
        return Dataset.from_tensor_slices(torch.arange(23)).shuffle(23, seed=1).map(lambda v: v * 10)

    share = [v.item() for v in made().worker_share(2, 1)]
    assert len(reads) == 11  # its rows only
    assert share == [v.item() for v in made()][1::2]


def test_as_numpy_iterator_keeps_structure_and_dtype():
    ds = Dataset.from_tensor_slices({"x": np.ones((2, 3), np.float64), "name": ["a", "b"]})
    first = next(ds.as_numpy_iterator())
    assert isinstance(first["x"], np.ndarray)
    assert first["x"].dtype == np.float64
    assert first["name"] == "a"
