"""phalanx.ps.pickle_cache: the chief reuses a closure's pickling only while pickling it again
would give the same bytes. Every case checks the cache's bytes against a fresh pickling."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from phalanx.ps import pickling
from phalanx.ps.pickle_cache import PICKLE_CACHE_ENV, PickleCache, pickle_cache_enabled

SCALE = 2.0  # a global a scheduled function reads


def _variable(name):  # what a variable travels as (the chief's handles, in miniature)
    return name


def _by_reference(obj):
    """Parameters travel by reference, as the chief sends its variables."""
    name = getattr(obj, "_test_variable", None) if isinstance(obj, torch.Tensor) else None
    return NotImplemented if name is None else (_variable, (name,))


def _dumps(cache, root):
    """The cache's bytes for ``root``, checked against a fresh pickling."""
    data = cache.dumps(root, _by_reference)
    assert data == pickling.dumps(root, _by_reference)
    return data


def _model_and_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    for name, p in model.named_parameters():
        p._test_variable = name
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[int] = []
    table = {"offset": 1}

    def step(x):
        seen.append(1)
        loss = model(x).sum() * SCALE + table["offset"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    return model, optimizer, seen, table, step


def test_the_same_closure_is_pickled_once():
    _, _, _, _, step = _model_and_step()
    cache = PickleCache()
    x = [1.0, 2.0]
    first = _dumps(cache, (step, (x,), {}))
    for _ in range(3):
        assert _dumps(cache, (step, (x,), {})) == first
    assert (cache.hits, cache.misses) == (3, 1)


@pytest.mark.parametrize(
    "change",
    [
        "learning_rate",
        "module_attribute",
        "module_replaced",
        "captured_list",
        "captured_dict",
        "optimizer_state",
        "hook",
        "float_sign",
    ],
)
def test_every_change_a_pickle_would_carry_is_seen(change):
    model, optimizer, seen, table, step = _model_and_step()
    cache = PickleCache()
    x = [1.0, 2.0]
    before = _dumps(cache, (step, (x,), {}))
    if change == "learning_rate":
        optimizer.param_groups[0]["lr"] = 0.2
    elif change == "module_attribute":
        model[0].note = "new"
    elif change == "module_replaced":
        model[1] = nn.Tanh()
    elif change == "captured_list":
        seen.append(2)
    elif change == "captured_dict":
        table["offset"] = 2
    elif change == "optimizer_state":
        optimizer.state[model[0].weight]["momentum_buffer"] = None
    elif change == "hook":
        model[0].register_forward_hook(lambda *a: None)
    elif change == "float_sign":
        optimizer.param_groups[0]["lr"] = 0.0
        before = _dumps(cache, (step, (x,), {}))
        optimizer.param_groups[0]["lr"] = -0.0
    after = _dumps(cache, (step, (x,), {}))
    assert after != before
    assert cache.misses >= 2
    assert cache.hits == 0


def test_a_new_argument_or_a_new_value_is_a_new_pickling():
    _, _, _, _, step = _model_and_step()
    cache = PickleCache()
    _dumps(cache, (step, (torch.ones(2, 4),), {}))
    _dumps(cache, (step, (3,), {}))
    _dumps(cache, (step, (4,), {}))
    _dumps(cache, (step, (4,), {"k": 1}))
    assert cache.hits == 0
    _dumps(cache, (step, (4,), {"k": 1}))
    assert cache.hits == 1


def test_globals_defaults_and_closure_cells_are_seen(monkeypatch):
    counter = 0

    def bump(by=1):
        nonlocal counter
        counter += by
        return counter * SCALE

    cache = PickleCache()
    _dumps(cache, (bump, (), {}))
    _dumps(cache, (bump, (), {}))
    assert cache.hits == 1
    counter = 5  # the closure cell
    _dumps(cache, (bump, (), {}))
    bump.__defaults__ = (2,)
    _dumps(cache, (bump, (), {}))
    monkeypatch.setitem(globals(), "SCALE", 3.0)
    _dumps(cache, (bump, (), {}))
    bump.tag = "x"  # the function's own attributes
    _dumps(cache, (bump, (), {}))
    assert (cache.hits, cache.misses) == (1, 5)


def test_a_tensor_pickled_by_value_is_pickled_every_time():
    weights = torch.ones(3)

    def use():
        return weights.sum()

    cache = PickleCache()
    _dumps(cache, (use, (), {}))
    weights.data.add_(1)  # no version bump: only pickling again sees it
    _dumps(cache, (use, (), {}))
    assert cache.hits == 0


def test_ordered_dict_default_dict_and_plain_objects():
    class Box:
        pass

    box, ordered, default = Box(), collections.OrderedDict(a=1), collections.defaultdict(list)
    box.value = 1

    def use():
        return box.value, ordered, default

    cache = PickleCache()
    _dumps(cache, (use, (), {}))
    _dumps(cache, (use, (), {}))
    assert cache.hits == 1
    for change in (
        lambda: setattr(box, "value", 2),
        lambda: ordered.move_to_end("a", last=False) or ordered.update(b=2),
        lambda: default["k"].append(1),
        lambda: setattr(default, "default_factory", dict),
        lambda: setattr(ordered, "extra", 1),
    ):
        change()
        _dumps(cache, (use, (), {}))
    assert cache.hits == 1
    assert cache.misses == 6


def test_the_cache_keeps_a_bounded_number_of_functions():
    cache = PickleCache(size=2)
    functions = [lambda i=i: i for i in range(3)]
    for fn in functions:
        _dumps(cache, (fn, (), {}))
    _dumps(cache, (functions[0], (), {}))  # forgotten: the least recently used
    assert cache.hits == 0
    _dumps(cache, (functions[2], (), {}))
    assert cache.hits == 1
    cache.clear()
    _dumps(cache, (functions[2], (), {}))
    assert cache.hits == 1


def test_the_switch(monkeypatch):
    monkeypatch.delenv(PICKLE_CACHE_ENV, raising=False)
    assert pickle_cache_enabled()
    monkeypatch.setenv(PICKLE_CACHE_ENV, "0")
    assert not pickle_cache_enabled()
    monkeypatch.setenv(PICKLE_CACHE_ENV, "yes")
    with pytest.raises(ValueError, match="PHALANX_PS_PICKLE_CACHE must be 0 or 1"):
        pickle_cache_enabled()
