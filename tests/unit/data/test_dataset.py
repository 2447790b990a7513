"""phalanx.data.Dataset: tf.data semantics for the subset the guides use."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from phalanx.data import INFINITE, UNKNOWN, Dataset, Options
from phalanx.input.options import AutoShardPolicy


def _values(ds):
    return [int(e) for e in ds]


def test_from_tensor_slices_structures_and_dtypes():
    ds = Dataset.from_tensor_slices(
        {"x": np.arange(6, dtype=np.float64).reshape(3, 2), "y": np.array([0, 1, 2])}
    )
    first = next(iter(ds))
    assert first["x"].dtype == torch.float64
    assert first["y"].item() == 0
    assert len(ds) == 3
    pairs = list(Dataset.from_tensor_slices((torch.ones(2, 3), torch.zeros(2))))
    assert pairs[1][0].shape == (3,)
    with pytest.raises(ValueError, match="same first dimension"):
        Dataset.from_tensor_slices((torch.ones(2), torch.ones(3)))
    with pytest.raises(ValueError, match="first dimension"):
        Dataset.from_tensor_slices(torch.tensor(1.0))


def test_batch_partial_and_drop_remainder_and_fast_path():
    ds = Dataset.range(10)
    assert [b.tolist() for b in ds.batch(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert ds.batch(4, drop_remainder=True).cardinality() == 2
    big = Dataset.from_tensor_slices((torch.randn(60000, 784), torch.arange(60000)))
    start = time.perf_counter()
    n = sum(1 for _ in big.batch(256))
    assert n == 235
    assert time.perf_counter() - start < 5  # slicing, not per-row stacking
    batches = list(big.batch(256, drop_remainder=True))
    assert batches[-1][1][-1].item() == 233 * 256 + 255
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        ds.batch(0)


def test_map_filter_parallel_and_unpacking():
    ds = Dataset.from_tensor_slices((torch.arange(8), torch.arange(8) * 10))
    assert [int(v) for v in ds.map(lambda a, b: a + b)] == [i * 11 for i in range(8)]
    assert [int(v) for v in ds.map(lambda a, b: a + b, num_parallel_calls=-1)] == [i * 11 for i in range(8)]
    assert _values(Dataset.range(10).filter(lambda v: v % 3 == 0)) == [0, 3, 6, 9]
    with pytest.raises(ValueError, match="num_parallel_calls"):
        ds.map(lambda a, b: a, num_parallel_calls=0)


def test_shuffle_is_seeded_and_reshuffles_per_epoch():
    ds = Dataset.range(20).shuffle(8, seed=3)
    first, second = _values(ds), _values(ds)
    assert sorted(first) == list(range(20))
    assert first != second  # reshuffled
    again = Dataset.range(20).shuffle(8, seed=3)
    assert _values(again) == first
    fixed = Dataset.range(20).shuffle(8, seed=3, reshuffle_each_iteration=False)
    assert _values(fixed) == _values(fixed)
    with pytest.raises(ValueError, match="buffer_size must be >= 1"):
        ds.shuffle(0)


def test_repeat_take_skip_shard_enumerate_concat_zip_cardinality():
    ds = Dataset.range(5)
    assert _values(ds.repeat(2)) == [0, 1, 2, 3, 4] * 2
    assert ds.repeat().cardinality() == INFINITE
    assert _values(ds.repeat().take(7)) == [0, 1, 2, 3, 4, 0, 1]
    assert ds.repeat().take(7).cardinality() == 7
    assert _values(ds.skip(3)) == [3, 4]
    assert _values(ds.shard(2, 1)) == [1, 3]
    assert ds.shard(2, 1).cardinality() == 2
    assert [int(i) for i, _ in ds.enumerate(10)] == [10, 11, 12, 13, 14]
    assert _values(ds.concatenate(Dataset.range(2))) == [0, 1, 2, 3, 4, 0, 1]
    assert len(list(Dataset.zip((ds, Dataset.range(3))))) == 3
    assert ds.filter(lambda v: True).cardinality() == UNKNOWN
    with pytest.raises(TypeError, match="unknown"):
        len(ds.filter(lambda v: True))
    with pytest.raises(TypeError, match="infinite"):
        len(ds.repeat())
    with pytest.raises(ValueError, match="shard needs"):
        ds.shard(2, 2)


def test_unbatch_cache_from_tensors_generator():
    assert _values(Dataset.range(6).batch(4).unbatch()) == list(range(6))
    calls = []
    cached = Dataset.from_generator(lambda: (calls.append(1) or i for i in range(3))).cache()
    assert _values(cached) == _values(cached) == [0, 1, 2]
    assert len(calls) == 3
    assert len(list(Dataset.from_tensors(torch.ones(2)).repeat(3))) == 3
    with pytest.raises(TypeError, match="from_generator needs a callable"):
        Dataset.from_generator([1, 2])


def test_prefetch_propagates_errors_and_stops_its_thread():
    assert _values(Dataset.range(50).prefetch(4)) == list(range(50))

    def boom(v):
        if int(v) == 3:
            raise RuntimeError("bad element")
        return v

    with pytest.raises(RuntimeError, match="bad element"):
        list(Dataset.range(10).map(boom).prefetch(2))
    it = iter(Dataset.range(10_000).prefetch(2))
    next(it)
    del it
    deadline = time.monotonic() + 5
    while any(t.name == "phalanx-prefetch" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "phalanx-prefetch" for t in threading.enumerate())
    with pytest.raises(ValueError, match="buffer_size must be >= 0"):
        Dataset.range(2).prefetch(-5)


def test_files_chain_can_be_rebuilt_over_a_subset(tmp_path):
    for i in range(4):
        np.save(tmp_path / f"part-{i}.npy", np.arange(i * 10, i * 10 + 5))

    def read(path):
        return iter(np.load(path))

    ds = (
        Dataset.list_files(str(tmp_path / "*.npy"))
        .interleave(read, cycle_length=2)
        .map(lambda v: v * 2)
        .batch(4)
    )
    files = ds.source_files()
    assert [f.rsplit("-", 1)[1] for f in files] == ["0.npy", "1.npy", "2.npy", "3.npy"]
    everything = sorted(int(v) for b in ds for v in b)
    assert everything == sorted(2 * v for i in range(4) for v in range(i * 10, i * 10 + 5))
    half = ds.with_source_files(files[::2])
    assert sorted(int(v) for b in half for v in b) == sorted(
        2 * v for i in (0, 2) for v in range(i * 10, i * 10 + 5)
    )
    from_files = Dataset.from_files(files[:1], read)
    assert from_files.source_files() == files[:1]
    assert Dataset.range(3).source_files() is None
    with pytest.raises(ValueError, match="not read from files"):
        Dataset.range(3).map(lambda v: v).with_source_files(files)
    with pytest.raises(ValueError, match="No files match"):
        Dataset.list_files(str(tmp_path / "*.csv"))
    shuffled = Dataset.list_files(str(tmp_path / "*.npy"), shuffle=True, seed=1)
    assert sorted(shuffled) == sorted(Dataset.list_files(str(tmp_path / "*.npy")))


def test_options_merge_outermost_wins():
    opts = Options()
    opts.experimental_distribute.auto_shard_policy = "data"
    ds = Dataset.range(3).with_options(opts)
    assert ds.options().experimental_distribute.auto_shard_policy is AutoShardPolicy.DATA
    outer = Options()
    outer.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    assert (
        ds.map(lambda v: v).with_options(outer).options().experimental_distribute.auto_shard_policy
        is AutoShardPolicy.OFF
    )
    assert Dataset.range(1).options().experimental_distribute.auto_shard_policy is AutoShardPolicy.AUTO
    with pytest.raises(ValueError, match="auto_shard_policy must be one of"):
        opts.experimental_distribute.auto_shard_policy = "sideways"
    with pytest.raises(TypeError, match="with_options needs"):
        ds.with_options({"a": 1})


def test_dataloader_interop_and_numpy_iterator():
    loader = torch.utils.data.DataLoader(Dataset.range(5).batch(2), batch_size=None)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    assert isinstance(next(Dataset.range(2).as_numpy_iterator()), np.ndarray)
