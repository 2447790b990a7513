"""File sources: list_files, from_files, interleave/flat_map, and rebuilding over a file subset."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from phalanx.data import UNKNOWN, Dataset
from phalanx.data.sources import Range


@pytest.fixture
def parts(tmp_path: pathlib.Path) -> list[str]:
    """Four .npy files; part-i holds i*10 .. i*10+4."""
    paths = []
    for i in range(4):
        path = tmp_path / f"part-{i}.npy"
        np.save(path, np.arange(i * 10, i * 10 + 5))
        paths.append(str(path))
    (tmp_path / "notes.txt").write_text("not data")
    return paths


def read(path: str):
    """Reader for one file: its rows."""
    return iter(np.load(path))


def test_list_files_sorted_strings(parts, tmp_path):
    ds = Dataset.list_files(str(tmp_path / "part-*.npy"))
    assert list(ds) == parts
    assert all(isinstance(p, str) for p in ds)
    assert ds.cardinality() == 4
    both = Dataset.list_files([tmp_path / "part-[13].npy", str(tmp_path / "*.txt"), tmp_path / "part-1.npy"])
    assert list(both) == [str(tmp_path / "notes.txt"), parts[1], parts[3]]  # sorted, each once


def test_list_files_shuffle_is_seeded_and_per_epoch(parts, tmp_path):
    pattern = str(tmp_path / "part-*.npy")
    a = Dataset.list_files(pattern, shuffle=True, seed=4)
    b = Dataset.list_files(pattern, shuffle=True, seed=4)
    epochs_a = [list(a) for _ in range(6)]
    assert epochs_a == [list(b) for _ in range(6)]
    assert all(sorted(e) == parts for e in epochs_a)
    assert len({tuple(e) for e in epochs_a}) > 1


def test_list_files_errors(tmp_path):
    with pytest.raises(ValueError, match=r"list_files found no file matching \['.*\*.csv'\]"):
        Dataset.list_files(str(tmp_path / "*.csv"))
    with pytest.raises(TypeError, match="list_files needs paths as str"):
        Dataset.list_files([3])


def test_from_files_reads_each_file_in_turn(parts):
    ds = Dataset.from_files(parts[:2], read)
    assert [int(v) for v in ds] == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert ds.source_files() == parts[:2]
    assert ds.cardinality() == UNKNOWN
    assert [int(v) for v in Dataset.from_files(pathlib.Path(parts[3]), read)] == [30, 31, 32, 33, 34]


def test_from_files_errors(parts):
    with pytest.raises(TypeError, match="from_files' reader must be callable"):
        Dataset.from_files(parts, "np.load")
    with pytest.raises(ValueError, match="from_files needs at least one path"):
        Dataset.from_files([], read)
    with pytest.raises(TypeError, match="from_files needs paths as str"):
        Dataset.from_files([1], read)


def test_interleave_follows_tf_data_order(tmp_path):
    lengths = {"a": 3, "b": 1, "c": 2}
    names = Dataset.from_tensor_slices(list(lengths))
    ds = names.interleave(lambda n: [f"{n}{i}" for i in range(lengths[n])], cycle_length=2)
    # tf.data: a0 b0 a1 | b ends, its slot waits for the next turn | a2 c0 | a ends | c1
    assert list(ds) == ["a0", "b0", "a1", "a2", "c0", "c1"]
    blocks = names.interleave(
        lambda n: [f"{n}{i}" for i in range(lengths[n])], cycle_length=2, block_length=2
    )
    assert list(blocks) == ["a0", "a1", "b0", "a2", "c0", "c1"]


def test_interleave_in_background_keeps_the_order(parts, tmp_path):
    files = Dataset.list_files(str(tmp_path / "part-*.npy"))
    sequential = [int(v) for v in files.interleave(read, cycle_length=3)]
    parallel = [int(v) for v in files.interleave(read, cycle_length=3, num_parallel_calls=-1)]
    assert parallel == sequential
    assert sorted(sequential) == [i * 10 + j for i in range(4) for j in range(5)]
    it = iter(files.interleave(read, cycle_length=2, num_parallel_calls=2))
    next(it)
    del it  # the background readers stop (checked by the thread fixture)


def test_flat_map_accepts_datasets_and_iterables():
    ds = Dataset.range(3).flat_map(lambda n: Dataset.range(int(n)))
    assert [int(v) for v in ds] == [0, 0, 1]
    pairs = Dataset.from_tensor_slices((torch.arange(2), torch.arange(2) + 5)).flat_map(lambda a, b: [a, b])
    assert [int(v) for v in pairs] == [0, 5, 1, 6]


def test_interleave_errors():
    with pytest.raises(TypeError, match="must return a Dataset or an iterable"):
        list(Dataset.range(2).flat_map(lambda n: 3))
    with pytest.raises(TypeError, match="interleave's fn must be callable"):
        Dataset.range(2).interleave(None)
    with pytest.raises(TypeError, match="flat_map's fn must be callable"):
        Dataset.range(2).flat_map(None)
    with pytest.raises(ValueError, match="cycle_length must be >= 1"):
        Dataset.range(2).interleave(lambda n: [n], cycle_length=0)
    with pytest.raises(ValueError, match="block_length must be >= 1"):
        Dataset.range(2).interleave(lambda n: [n], block_length=0)


def test_source_files_and_rebuild_over_a_subset(parts, tmp_path):
    ds = (
        Dataset.list_files(str(tmp_path / "part-*.npy"))
        .interleave(read, cycle_length=2)
        .map(lambda v: v * 2)
        .batch(4)
    )
    assert ds.source_files() == parts
    assert sorted(int(v) for b in ds for v in b) == sorted(
        2 * v for i in range(4) for v in range(i * 10, i * 10 + 5)
    )
    half = ds.with_source_files(parts[1::2])
    assert half.source_files() == parts[1::2]
    assert [b.tolist() for b in half] == [[20, 60, 22, 62], [24, 64, 26, 66], [28, 68]]
    assert ds.source_files() == parts  # the original is unchanged


def test_rebuilt_chains_recompute_cardinality_and_state(parts, tmp_path):
    files = Dataset.list_files(str(tmp_path / "part-*.npy"))
    assert files.batch(3).with_source_files(parts[:2]).cardinality() == 1
    cached = files.shuffle(4, seed=1).cache()
    first = list(cached)
    rebuilt = cached.with_source_files(parts[:3])
    assert sorted(rebuilt) == parts[:3]  # not the original's cache
    assert list(cached) == first


def test_rebuild_errors(parts):
    with pytest.raises(ValueError, match="with_source_files needs a dataset read from files"):
        Dataset.range(3).map(lambda v: v).with_source_files(parts)
    zipped = Dataset.zip((Dataset.from_files(parts, read), Dataset.range(3)))
    assert zipped.source_files() is None
    with pytest.raises(ValueError, match="with_source_files needs a dataset read from files"):
        zipped.with_source_files(parts)
    with pytest.raises(TypeError, match="with_source_files needs paths as str"):
        Dataset.from_files(parts, read).with_source_files([None])


def test_only_file_sources_rebuild_over_files():
    with pytest.raises(NotImplementedError, match="range does not read files"):
        Range(range(3), torch.int64).with_files(["a"])
