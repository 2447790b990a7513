"""The chief pickles a scheduled function once for repeated schedules of it.

A training loop schedules the same function with the same arguments thousands of times
(``coordinator.schedule(step, args=(iterator,))``), and pickling it again for every closure
costs the chief more than any other part of a small step (0.7 ms for an embedding step: the
function, the model and the optimizer it reaches). `PickleCache` keeps the bytes of the last
pickling of each function and reuses them while an exact test says that pickling again would
give the same bytes:

* the closure is made of the same objects (function, arguments, keyword arguments, by
  identity);
* every built-in container the pickle reached (``dict``, ``list``, ``set``, ``bytearray``,
  recorded from the pickler's memo) holds the same keys and the same objects, in the same
  order;
* every other object it reached reduces to the same thing as when it was pickled: the same
  callable, the same objects by identity, inside containers of the same shape (`_same`).
  This is how a function is checked (its code, defaults, closure cells, the globals it
  names, its submodules: cloudpickle's own reduction), a module (its ``__dict__`` copy), an
  optimizer (its ``defaults``, ``state`` and ``param_groups``), a variable (its handle);
* strings, bytes, numbers, tuples, frozensets and code objects cannot change.
* a class or function pickled by its name (cloudpickle's own test, without reducing it
  again): the same module and qualified name, the module still in ``sys.modules`` and holding
  it under that name, and not registered to be pickled by value.

Recording costs about twice a plain pickling, so a function is recorded from its second
schedule on (one made anew for every schedule, a lambda in the loop, never is), and a function
whose closures changed twice in a row is pickled plainly, and recorded again every 32nd time
(arguments that differ at every schedule).

The recorded objects are held (strongly) by the cache entry, so an identity that matches is
the same object, never a new one at a reused address. What reduces to new objects every time
(a tensor that is not a variable: torch builds a new storage object for it) never passes the
test: such a closure is pickled every time, as without the cache. Any change the test misses
would be a change that does not reach the pickle's bytes.
"""

from __future__ import annotations

import collections
import copyreg
import io
import math
import pickle
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch

from phalanx import settings
from phalanx.ps import pickling

__all__ = ["PICKLE_CACHE_ENV", "PickleCache", "pickle_cache_enabled"]

PICKLE_CACHE_ENV = "PHALANX_PS_PICKLE_CACHE"


def pickle_cache_enabled() -> bool:
    """Whether the chief reuses picklings (``PHALANX_PS_PICKLE_CACHE``: ``1``, the default,
    or ``0`` to pickle every closure, for A/B measurements).

    Raises:
        ValueError: Another value.
    """
    return settings.current().ps_pickle_cache


_SCALARS = (str, bytes, int, bool, complex, type(None))
_GLOBAL = "__phalanx_pickled_by_name__"  # the marker of an object pickled by its name


def _same(a: Any, b: Any) -> bool:
    """Whether two reductions pickle the same: identical objects, equal scalars, and fresh
    containers (made by the reduction) of the same shape holding the same."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is tuple or kind is list:
        return len(a) == len(b) and all(map(_same, a, b))
    if kind is dict:
        return len(a) == len(b) and all(map(_same, a, b)) and all(map(_same, a.values(), b.values()))
    if kind is float:  # 0.0 == -0.0 and nan != nan: compare what the pickle writes
        return bool(a == b and math.copysign(1.0, a) == math.copysign(1.0, b))
    if kind in _SCALARS:
        return bool(a == b)
    if kind is types.CellType:  # cloudpickle's fresh cells: empty, or holding the same
        return _cell(a) is _cell(b)
    return False


_EMPTY = object()


def _cell(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _by_name(obj: Any, name: str | None = None) -> tuple[Any, ...]:
    """The marker of an object pickled by its module and name (what ``save_global`` reads)."""
    name = name or getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if module is None and name is not None:  # the pickler looks for it in sys.modules
        module = pickle.whichmodule(obj, name)  # type: ignore[attr-defined]
    return (_GLOBAL, module, name)


def _materialized(reduction: Any) -> tuple[Any, Any]:
    """(what the pickler gets, what is recorded): list and dict items of a reduction are
    iterators, read once; the record keeps them as lists."""
    if isinstance(reduction, tuple) and len(reduction) > 3:
        items = list(reduction)
        for i in (3, 4):
            if i < len(items) and items[i] is not None and not isinstance(items[i], list):
                items[i] = list(items[i])
        fed = tuple(iter(x) if i in (3, 4) and x is not None else x for i, x in enumerate(items))
        return fed, tuple(items)
    return reduction, reduction


class _Recording(pickling._Pickler):
    """The chief's pickler that also records what each object was reduced to."""

    def __init__(self, file: io.BytesIO, replace: Callable[[Any], Any]) -> None:
        super().__init__(file, replace)
        self.reductions: list[tuple[Any, Any]] = []  # (object, its reduction)
        self.snapshots: list[tuple[Any, tuple[Any, ...]]] = []  # (object, `_snapshot`)

    def reduction(self, obj: Any) -> Any:
        """What the pickler writes for ``obj``, in the C pickler's order: reducer_override,
        a name for classes and functions, the dispatch table, a name for classes of other
        metaclasses, ``__reduce_ex__``; a `_GLOBAL` tuple means "pickled by its name"."""
        reduced = pickling._Pickler.reducer_override(self, obj)
        if reduced is not NotImplemented:
            return reduced
        kind = type(obj)
        if kind is type or kind is types.FunctionType:
            return _by_name(obj)
        reduce = self.dispatch_table.get(kind)
        if reduce is not None:
            reduced = reduce(obj)
        elif isinstance(obj, type):
            return _by_name(obj)
        else:
            reduced = obj.__reduce_ex__(self.proto)
        return _by_name(obj, reduced) if isinstance(reduced, str) else reduced

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):  # immutable: nothing to record
            return super().reducer_override(obj)
        reduced = self.reduction(obj)
        if isinstance(reduced, tuple) and reduced and reduced[0] is _GLOBAL:
            self.reductions.append((obj, reduced))
            return NotImplemented
        fed, recorded = _materialized(reduced)
        snapshot = _snapshot(obj) if self.by_value(obj) else None
        if snapshot is not None:
            self.snapshots.append((obj, snapshot))
        else:
            self.reductions.append((obj, recorded))
        return fed

    def by_value(self, obj: Any) -> bool:
        """Whether no override of phalanx or cloudpickle reduces ``obj`` (a decision that
        depends on its type only, for the types `_snapshot` takes)."""
        return pickling._Pickler.reducer_override(self, obj) is NotImplemented


def _default_reduce(kind: type) -> bool:
    """Whether pickling an instance of ``kind`` writes its class and its ``__dict__`` (all of
    it, or all but ``_compiled_call_impl`` for a torch module) and nothing else."""
    plain = _PLAIN.get(kind)
    if plain is None:
        getstate = getattr(kind, "__getstate__", None)
        plain = (
            kind.__reduce_ex__ is object.__reduce_ex__  # type: ignore[comparison-overlap]
            and kind.__reduce__ is object.__reduce__  # type: ignore[comparison-overlap]
            and getstate in (object.__getstate__, torch.nn.Module.__getstate__)  # type: ignore[attr-defined]
            and not copyreg._slotnames(kind)  # type: ignore[attr-defined]
            and not hasattr(kind, "__getnewargs_ex__")
            and not hasattr(kind, "__getnewargs__")
            and not issubclass(kind, (list, dict, set))
            and kind not in copyreg.dispatch_table
            and kind not in cloudpickle.Pickler.dispatch_table
        )
        _PLAIN[kind] = plain
    return plain


_PLAIN: dict[type, bool] = {}


def _snapshot(obj: Any) -> tuple[Any, ...] | None:
    """A cheap exact record of what the pickle of ``obj`` holds, for the commonest kinds
    (None: check ``obj`` by its reduction): an ``OrderedDict`` without attributes, a
    ``defaultdict``, an object pickled as its class and ``__dict__`` (a torch module)."""
    kind = type(obj)
    if kind is collections.OrderedDict:
        return None if vars(obj) else (kind, None, tuple(obj), tuple(obj.values()))
    if kind is collections.defaultdict:
        return (kind, obj.default_factory, tuple(obj), tuple(obj.values()))
    if _default_reduce(kind):
        state = obj.__dict__
        return (kind, state, tuple(state), tuple(state.values()))
    return None


def _snapshot_unchanged(obj: Any, snapshot: tuple[Any, ...]) -> bool:
    kind, extra, keys, values = snapshot
    if type(obj) is not kind:
        return False
    if kind is collections.OrderedDict:
        if vars(obj):
            return False
        items = obj
    elif kind is collections.defaultdict:
        if obj.default_factory is not extra:
            return False
        items = obj
    else:
        items = obj.__dict__
        if items is not extra:
            return False
    return len(items) == len(keys) and all(map(_is, items, keys)) and all(map(_is, items.values(), values))


class _Entry:
    """One pickling: its bytes and what they were made from."""

    def __init__(self, data: bytes, root: Any, pickler: _Recording) -> None:
        self.data, self.root = data, root
        self.snapshots = pickler.snapshots
        # classes and functions pickled by name are checked by what decides it (`_named`)
        self.named = [named for obj, reduced in pickler.reductions if (named := _named(obj, reduced))]
        self.reductions = [(obj, reduced) for obj, reduced in pickler.reductions if not _named(obj, reduced)]
        self.containers: list[tuple[Any, tuple[Any, ...], tuple[Any, ...]]] = []
        self.held = [obj for _, obj in pickler.memo.copy().values()]  # keeps identities valid
        for obj in self.held:
            kind = type(obj)
            if kind is dict:
                self.containers.append((obj, tuple(obj), tuple(obj.values())))
            elif kind is list or kind is set:
                self.containers.append((obj, tuple(obj), ()))
            elif kind is bytearray:
                self.containers.append((obj, (bytes(obj),), ()))

    def unchanged(self, root: Any, replace: Callable[[Any], Any]) -> bool:
        """Whether pickling ``root`` now would give ``self.data`` (see the module docstring)."""
        if not (_same_function(root[0], self.root[0]) and _same(root[1:], self.root[1:])):
            return False
        for obj, keys, values in self.containers:
            if not _container_unchanged(obj, keys, values):
                return False
        for obj, snapshot in self.snapshots:
            if not _snapshot_unchanged(obj, snapshot):
                return False
        # no override takes a snapshot's object while its type stays (they decide by type, or
        # by identity with the strategy and the coordinator, which a snapshot's object is not)
        if not all(_still_named(*named) for named in self.named):
            return False
        checker = _Recording(io.BytesIO(), replace)
        return all(_same(_recorded(checker, obj), reduced) for obj, reduced in self.reductions)


def _named(obj: Any, reduced: Any) -> tuple[Any, str, str, Any] | None:
    """``(obj, module name, qualified name, module)`` for a class or function that was pickled
    by its name (None for anything else): what `_still_named` checks instead of reducing it
    again. Only plain classes and functions: the overrides decide for them by type and identity
    (never true for a class or a function), the recorder names them before any dispatch table."""
    kind = type(obj)
    if not (kind is type or kind is types.FunctionType):
        return None
    if not (isinstance(reduced, tuple) and len(reduced) == 3 and reduced[0] is _GLOBAL):
        return None
    _, module_name, name = reduced
    if getattr(obj, "__module__", None) != module_name or getattr(obj, "__qualname__", None) != name:
        return None  # named through pickle.whichmodule: reduced again at every check
    module = sys.modules.get(module_name)
    return None if module is None else (obj, module_name, name, module)


def _still_named(obj: Any, module_name: str, name: str, module: Any) -> bool:
    """Whether cloudpickle would still pickle ``obj`` by the same name: the same module and
    qualified name, the module still in ``sys.modules`` and holding ``obj`` under that name,
    and not registered to be pickled by value (cloudpickle's `_should_pickle_by_reference`)."""
    if (
        obj.__module__ != module_name
        or obj.__qualname__ != name
        or sys.modules.get(module_name) is not module
    ):
        return False
    found: Any = module
    for part in name.split("."):
        found = getattr(found, part, _EMPTY)
    return found is obj and not cloudpickle.cloudpickle._is_registered_pickle_by_value(module)


def _container_unchanged(obj: Any, keys: tuple[Any, ...], values: tuple[Any, ...]) -> bool:
    if type(obj) is bytearray:
        return bytes(obj) == keys[0]
    if len(obj) != len(keys) or not all(map(_is, obj, keys)):
        return False
    return type(obj) is not dict or all(map(_is, obj.values(), values))


def _is(a: Any, b: Any) -> bool:
    return a is b


def _recorded(checker: _Recording, obj: Any) -> Any:
    reduced = checker.reduction(obj)
    if isinstance(reduced, tuple) and reduced and reduced[0] is _GLOBAL:
        return reduced
    return _materialized(reduced)[1]


_TRACKED = 32  # functions whose schedules are counted (the least recently scheduled goes)
_RETRY_EVERY = 32  # a function whose closures kept changing is recorded again this often


def _key(fn: Any) -> Any:
    """A function's key: a bound method is made anew at every ``obj.method`` access, so it is
    known by its function and its object."""
    if isinstance(fn, types.MethodType):
        return (id(fn.__func__), id(fn.__self__))
    return id(fn)


def _same_function(a: Any, b: Any) -> bool:
    if isinstance(a, types.MethodType) and isinstance(b, types.MethodType):
        return a.__func__ is b.__func__ and a.__self__ is b.__self__
    return a is b


class _Track:
    """One scheduled function: how often it was scheduled, how often in a row its closure
    changed, and its recorded pickling."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.scheduled, self.changed = fn, 0, 0
        self.entry: _Entry | None = None

    def wants_recording(self) -> bool:
        """Record a function from its second schedule on (a function made anew for every
        schedule never is), and not while its closures keep changing (then every
        `_RETRY_EVERY`-th time): recording costs about twice a plain pickling."""
        if self.scheduled < 2:
            return False
        return self.changed < 2 or self.scheduled % _RETRY_EVERY == 0


class PickleCache:
    """The last pickling of each scheduled function, reused while `_Entry.unchanged` holds.
    Thread-safe (the coordinator's worker threads pickle at once).

    Args:
        size: How many functions to track (the least recently scheduled goes first).
    """

    def __init__(self, size: int = _TRACKED) -> None:
        self._size = size
        self._tracks: collections.OrderedDict[Any, _Track] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def dumps(self, root: tuple[Any, ...], replace: Callable[[Any], Any]) -> bytes:
        """Pickles ``root`` (a closure's ``(fn, args, kwargs)``) as `phalanx.ps.pickling.dumps`
        with ``replace`` would, reusing an earlier pickling of it when nothing it reaches
        changed.

        Raises:
            Whatever pickling ``root`` raises.
        """
        with self._lock:
            track = self._track(root[0])
            entry = track.entry
            if entry is not None:
                if entry.unchanged(root, replace):
                    self.hits += 1
                    track.changed = 0
                    return entry.data
                track.entry, track.changed = None, track.changed + 1
            record = track.wants_recording()
            self.misses += 1
        if not record:
            return pickling.dumps(root, replace)
        buffer = io.BytesIO()
        pickler = _Recording(buffer, replace)
        pickler.dump(root)
        entry = _Entry(buffer.getvalue(), root, pickler)
        with self._lock:
            track.entry = entry
        return entry.data

    def _track(self, fn: Any) -> _Track:
        key = _key(fn)
        track = self._tracks.get(key)
        if track is None or not _same_function(track.fn, fn):
            track = self._tracks[key] = _Track(fn)
        self._tracks.move_to_end(key)
        while len(self._tracks) > self._size:
            self._tracks.popitem(last=False)
        track.scheduled += 1
        return track

    def clear(self) -> None:
        """Forgets every pickling (and the objects it held)."""
        with self._lock:
            self._tracks.clear()
