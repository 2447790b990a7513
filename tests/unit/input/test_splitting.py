"""TF's rule for splitting a global batch across replicas."""

from __future__ import annotations

import pytest

from phalanx.input.splitting import split_sizes


def test_split_sizes_follow_tf():
    assert split_sizes(32, 2) == [16, 16]
    assert split_sizes(25, 2) == [13, 12]
    assert split_sizes(26, 2) == [13, 13]
    assert split_sizes(1, 2) == [1, 0]
    assert split_sizes(5, 4) == [2, 1, 1, 1]
    with pytest.raises(ValueError, match="num_parts must be >= 1"):
        split_sizes(3, 0)
