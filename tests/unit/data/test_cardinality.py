"""cardinality(): known counts through the chain, INFINITE for endless repeats, UNKNOWN otherwise."""

from __future__ import annotations

import pytest
import torch

from phalanx.data import INFINITE, UNKNOWN, Dataset, Options

TEN = Dataset.range(10)
ENDLESS = TEN.repeat()
UNSURE = TEN.filter(lambda v: True)

CASES = {
    "from_tensor_slices": (Dataset.from_tensor_slices(torch.zeros(7, 2)), 7),
    "from_tensors": (Dataset.from_tensors(torch.zeros(7, 2)), 1),
    "range": (Dataset.range(3, 10, 2), 4),
    "from_generator": (Dataset.from_generator(lambda: iter([1])), UNKNOWN),
    "map": (TEN.map(lambda v: v), 10),
    "filter": (UNSURE, UNKNOWN),
    "enumerate": (TEN.enumerate(), 10),
    "cache": (TEN.cache(), 10),
    "prefetch": (TEN.prefetch(2), 10),
    "shuffle": (TEN.shuffle(4), 10),
    "with_options": (ENDLESS.with_options(Options()), INFINITE),
    "batch": (TEN.batch(3), 4),
    "batch drop_remainder": (TEN.batch(3, drop_remainder=True), 3),
    "batch infinite": (ENDLESS.batch(3), INFINITE),
    "batch unknown": (UNSURE.batch(3), UNKNOWN),
    "unbatch": (TEN.batch(2).unbatch(), UNKNOWN),
    "repeat(3)": (TEN.repeat(3), 30),
    "repeat(0)": (TEN.repeat(0), 0),
    "repeat()": (ENDLESS, INFINITE),
    "repeat() of empty": (Dataset.range(0).repeat(), 0),
    "repeat() of unknown": (UNSURE.repeat(), INFINITE),
    "repeat(2) of unknown": (UNSURE.repeat(2), UNKNOWN),
    "take": (TEN.take(4), 4),
    "take more": (TEN.take(40), 10),
    "take(-1)": (TEN.take(-1), 10),
    "take of infinite": (ENDLESS.take(4), 4),
    "take of unknown": (UNSURE.take(4), UNKNOWN),
    "skip": (TEN.skip(4), 6),
    "skip more": (TEN.skip(40), 0),
    "skip(-1)": (TEN.skip(-1), 0),
    "skip of infinite": (ENDLESS.skip(4), INFINITE),
    "shard": (TEN.shard(3, 0), 4),
    "shard last": (TEN.shard(3, 2), 3),
    "shard of infinite": (ENDLESS.shard(3, 2), INFINITE),
    "zip": (Dataset.zip((TEN, Dataset.range(4))), 4),
    "zip with infinite": (Dataset.zip((TEN, ENDLESS)), 10),
    "zip of infinites": (Dataset.zip((ENDLESS, ENDLESS)), INFINITE),
    "zip with unknown": (Dataset.zip((TEN, UNSURE)), UNKNOWN),
    "concatenate": (TEN.concatenate(Dataset.range(4)), 14),
    "concatenate infinite": (UNSURE.concatenate(ENDLESS), INFINITE),
    "concatenate unknown": (TEN.concatenate(UNSURE), UNKNOWN),
    "flat_map": (TEN.flat_map(lambda v: [v]), UNKNOWN),
    "interleave": (TEN.interleave(lambda v: [v], cycle_length=2), UNKNOWN),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cardinality(name):
    ds, expected = CASES[name]
    assert ds.cardinality() == expected
    if expected >= 0:
        assert len(ds) == expected
        assert len(list(ds)) == expected


def test_len_of_unknown_or_infinite_is_a_type_error():
    with pytest.raises(TypeError, match=r"length is unknown \(filter, a generator, files...\).*HINT"):
        len(UNSURE)
    with pytest.raises(TypeError, match=r"length is infinite \(repeat\(\) without a count\)"):
        len(ENDLESS)
    assert list(UNSURE) == list(TEN)  # list() falls back when len() raises TypeError


def test_a_dataset_is_truthy_whatever_its_length():
    assert Dataset.range(0)
    assert UNSURE
    assert repr(TEN.batch(3)) == "<Dataset range(0, 10, 1) -> batch(3), cardinality=4>"
    assert "cardinality=unknown" in repr(UNSURE)
    assert repr(Dataset.zip((TEN, ENDLESS))).startswith(
        "<Dataset zip(range(0, 10, 1), range(0, 10, 1) -> repeat())"
    )
