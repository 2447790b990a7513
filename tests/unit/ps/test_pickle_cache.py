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


def _warm(cache, root):
    """Schedules ``root`` until its pickling is recorded (the second time) and reused once."""
    first = _dumps(cache, root)
    for _ in range(2):
        assert _dumps(cache, root) == first
    assert cache.hits == 1
    return first


def test_the_same_closure_is_pickled_once():
    _, _, _, _, step = _model_and_step()
    cache = PickleCache()
    x = [1.0, 2.0]
    first = _dumps(cache, (step, (x,), {}))
    for _ in range(4):
        assert _dumps(cache, (step, (x,), {})) == first
    assert (cache.hits, cache.misses) == (3, 2)  # plain, recorded, then reused


def test_a_bound_method_is_the_same_function_at_every_access():
    class Trainer:
        def __init__(self):
            self.scale = 2.0

        def step(self, x):
            return x * self.scale

    trainer = Trainer()
    cache = PickleCache()
    for _ in range(4):
        _dumps(cache, (trainer.step, (1.0,), {}))
    assert cache.hits == 2
    trainer.scale = 3.0
    _dumps(cache, (trainer.step, (1.0,), {}))
    assert cache.hits == 2
    _dumps(cache, (Trainer().step, (1.0,), {}))  # another object
    assert cache.hits == 2


def test_a_function_made_anew_for_every_schedule_is_never_recorded():
    cache = PickleCache()
    for i in range(5):
        _dumps(cache, (lambda i=i: i, (), {}))
    assert cache.hits == 0
    assert all(track.entry is None for track in cache._tracks.values())


def test_arguments_that_change_every_time_stop_the_recording_until_a_retry():
    def step(x):
        return x

    cache = PickleCache()
    for value in range(31):
        _dumps(cache, (step, (value,), {}))
    (track,) = cache._tracks.values()
    assert cache.hits == 0
    assert track.changed == 2  # recorded twice, changed twice: now pickled plainly
    assert track.entry is None
    _dumps(cache, (step, (30,), {}))  # the 32nd schedule: recorded again
    assert track.entry is not None
    _dumps(cache, (step, (30,), {}))
    assert cache.hits == 1
    assert track.changed == 0


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
    before = _warm(cache, (step, (x,), {}))
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
        _dumps(cache, (step, (x,), {}))  # recorded anew
        before = _dumps(cache, (step, (x,), {}))
        assert cache.hits == 2
        optimizer.param_groups[0]["lr"] = -0.0
    hits = cache.hits
    after = _dumps(cache, (step, (x,), {}))
    assert after != before
    assert cache.hits == hits


def test_a_new_argument_or_a_new_value_is_a_new_pickling():
    _, _, _, _, step = _model_and_step()
    cache = PickleCache()
    _warm(cache, (step, (3,), {}))
    for args, kwargs in (((4,), {}), ((4,), {"k": 1})):
        _dumps(cache, (step, args, kwargs))
        assert cache.hits == 1
    _dumps(cache, (step, (torch.ones(2, 4),), {}))  # a tensor by value: never the same
    assert cache.hits == 1


def test_globals_defaults_and_closure_cells_are_seen(monkeypatch):
    counter = 0

    def bump(by=1):
        nonlocal counter
        counter += by
        return counter * SCALE

    cache = PickleCache()
    _warm(cache, (bump, (), {}))

    def set_cell():
        nonlocal counter
        counter = 5

    changes = [
        set_cell,  # the closure cell
        lambda: setattr(bump, "__defaults__", (2,)),
        lambda: monkeypatch.setitem(globals(), "SCALE", 3.0),
        lambda: setattr(bump, "tag", "x"),  # the function's own attributes
    ]
    for change in changes:
        change()
        _dumps(cache, (bump, (), {}))  # seen: pickled again, and recorded anew
        assert cache.hits == 1
        _dumps(cache, (bump, (), {}))
        assert cache.hits == 2
        cache.hits = 1


def test_a_tensor_pickled_by_value_is_pickled_every_time():
    weights = torch.ones(3)

    def use():
        return weights.sum()

    cache = PickleCache()
    for _ in range(3):
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
    _warm(cache, (use, (), {}))
    for change in (
        lambda: setattr(box, "value", 2),
        lambda: ordered.move_to_end("a", last=False) or ordered.update(b=2),
        lambda: default["k"].append(1),
        lambda: setattr(default, "default_factory", dict),
        lambda: setattr(ordered, "extra", 1),
    ):
        change()
        _dumps(cache, (use, (), {}))  # seen: pickled again, and recorded anew
        assert cache.hits == 1
        _dumps(cache, (use, (), {}))
        assert cache.hits == 2
        cache.hits = 1


def test_the_cache_keeps_a_bounded_number_of_functions():
    cache = PickleCache(size=2)
    functions = [lambda i=i: i for i in range(3)]
    for fn in functions:
        _warm(cache, (fn, (), {}))
        cache.hits = 0
    _dumps(cache, (functions[0], (), {}))  # forgotten: the least recently scheduled
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


def _helper(x):  # pickled by its name while this module holds it under that name
    return x + 1


class _Kind:
    pass


@pytest.mark.parametrize("change", ["module attribute", "by value", "qualified name"])
def test_a_class_or_function_pickled_by_name_is_seen_when_its_name_would_change(change, monkeypatch):
    """A class or function reached by a closure is pickled by its name only while cloudpickle
    finds it there and its module is not registered to go by value: each change of that makes
    the next schedule pickle again (and cloudpickle then writes it by value)."""
    import sys

    import cloudpickle

    module = sys.modules[__name__]

    def step(helper=_helper, kind=_Kind):
        return helper(1), kind

    cache = PickleCache()
    first = _warm(cache, (step, (), {}))
    if change == "module attribute":
        monkeypatch.setattr(module, "_helper", lambda x: x)
    elif change == "qualified name":
        _Kind.__qualname__ = "_Renamed"
    else:
        cloudpickle.register_pickle_by_value(module)
    try:
        assert _dumps(cache, (step, (), {})) != first
        assert cache.hits == 1
    finally:
        _Kind.__qualname__ = "_Kind"
        if change == "by value":
            cloudpickle.unregister_pickle_by_value(module)
        monkeypatch.undo()
    assert _dumps(cache, (step, (), {})) == first
