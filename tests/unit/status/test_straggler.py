"""The straggler rule on synthetic wait fractions: the worker the others wait for, alone."""

from __future__ import annotations

import pytest

from phalanx.status.straggler import GAP, find_straggler


@pytest.mark.parametrize(
    ("fractions", "expected"),
    [
        # two workers, one slowed: its peer waits most of each step, it barely waits
        ({"worker:0": 0.89, "worker:1": 0.02}, "worker:1"),
        ({"worker:0": 0.02, "worker:1": 0.89}, "worker:0"),
        # four workers, one slow: all three others wait for it
        ({"worker:0": 0.6, "worker:1": 0.55, "worker:2": 0.05, "worker:3": 0.62}, "worker:2"),
        # a balanced job: fractions differ by noise only
        ({"worker:0": 0.12, "worker:1": 0.10, "worker:2": 0.15}, None),
        # two equally slow workers: neither waits for the other, so neither stands apart
        ({"worker:0": 0.7, "worker:1": 0.03, "worker:2": 0.04, "worker:3": 0.72}, None),
        # one worker, or none measured yet: no straggler
        ({"worker:0": 0.0}, None),
        ({}, None),
        # the chief computing alone (evaluating, saving): the others wait for it
        ({"chief:0": 0.0, "worker:0": 0.5, "worker:1": 0.5}, "chief:0"),
    ],
)
def test_the_straggler_is_the_worker_that_waits_least_by_a_clear_gap(fractions, expected):
    assert find_straggler(fractions) == expected


def test_the_gap_is_inclusive_and_can_be_changed():
    assert find_straggler({"worker:0": 0.3, "worker:1": 0.3 - GAP}) == "worker:1"
    assert find_straggler({"worker:0": 0.3, "worker:1": 0.3 - GAP + 0.01}) is None
    assert find_straggler({"worker:0": 0.3, "worker:1": 0.24}, gap=0.05) == "worker:1"


def test_equal_fractions_name_no_one():
    assert find_straggler({"worker:0": 0.4, "worker:1": 0.4}) is None
