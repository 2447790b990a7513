"""RemoteValue: the future result of a scheduled function, one state at a time (no processes)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from phalanx.ps.coordinator.remote_value import RemoteValue, RemoteValueStatus


def test_a_new_value_is_not_ready_and_a_timed_out_wait_says_how_to_wait():
    value = RemoteValue()
    assert value.status is RemoteValueStatus.NOT_READY
    assert repr(value) == "RemoteValue(status=NOT_READY)"
    message = r"get\(\) of the scheduled function did not finish within its timeout of 0\.01s\. .*HINT: call"
    with pytest.raises(TimeoutError, match=message):
        value.get(timeout=0.01)
    with pytest.raises(TimeoutError, match="did not finish"):
        value.fetch(timeout=0.01)


def test_get_keeps_tensors_and_fetch_gives_numpy_through_containers():
    point = collections.namedtuple("point", ["x", "y"])
    value = RemoteValue()
    value.set_result({"a": [torch.ones(2)], "p": point(torch.zeros(1), 3), "s": "text"})
    assert value.status is RemoteValueStatus.READY
    assert isinstance(value.get()["a"][0], torch.Tensor)
    fetched = value.fetch()
    assert isinstance(fetched["a"][0], np.ndarray)
    assert isinstance(fetched["p"], point)
    assert isinstance(fetched["p"].x, np.ndarray)
    assert fetched["p"].y == 3
    assert fetched["s"] == "text"


def test_a_failed_function_aborts_the_value_and_fetch_raises_its_error():
    value = RemoteValue()
    value.set_exception(KeyError("missing"))
    assert value.status is RemoteValueStatus.ABORTED
    with pytest.raises(KeyError, match="missing"):
        value.fetch()
    with pytest.raises(KeyError, match="missing"):
        value.get()


def test_a_retried_function_makes_its_value_not_ready_again():
    value = RemoteValue()
    value.set_exception(RuntimeError("lost"))
    value._reset()
    assert value.status is RemoteValueStatus.NOT_READY
    value.set_result(7)
    assert value.fetch() == 7
