"""The public names of phalanx.data are frozen here: changing them must be deliberate."""

from __future__ import annotations

import phalanx.data
from phalanx.input.input_options import AutoShardPolicy


def test_public_names_are_frozen():
    assert sorted(phalanx.data.__all__) == sorted(
        [
            "AUTOTUNE",
            "INFINITE",
            "UNKNOWN",
            "AutoShardPolicy",
            "Dataset",
            "DistributeOptions",
            "Options",
            "experimental",
        ]
    )
    for name in phalanx.data.__all__:
        assert hasattr(phalanx.data, name), name


def test_sentinels_match_tf_data():
    assert (phalanx.data.AUTOTUNE, phalanx.data.INFINITE, phalanx.data.UNKNOWN) == (-1, -1, -2)
    assert phalanx.data.AutoShardPolicy is AutoShardPolicy
