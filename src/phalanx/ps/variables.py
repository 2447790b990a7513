"""Handles to the variables that live on parameter-server tasks, and the client that reads
and writes them (used by the coordinator and by every worker)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import torch

from phalanx.ps import messages, sharding
from phalanx.ps.handles import VariableHandle
from phalanx.ps.transport import RpcClient

__all__ = ["BufferChanges", "PSClient", "Patch", "VariableHandle"]

T = TypeVar("T")
Known = Mapping[str, tuple[str, int]]  # ps variable -> (its store's identity, the version a copy holds)


class Patch(NamedTuple):
    """Part of a variable's newer value: ``value`` goes to ``rows`` along its first axis (row
    numbers, a slice of a shard, or None: the whole variable)."""

    rows: torch.Tensor | slice | None
    value: torch.Tensor

    def apply(self, tensor: torch.Tensor) -> None:
        """Writes ``value`` into ``tensor`` (a copy of the variable), in place."""
        if self.rows is None:
            tensor.copy_(self.value)
        elif isinstance(self.rows, slice):
            tensor[self.rows].copy_(self.value)
        else:
            tensor.index_copy_(0, self.rows, self.value)


@dataclasses.dataclass
class BufferChanges:
    """What a scheduled function changed in module buffers (BatchNorm statistics, metric
    states): a delta per buffer, which the coordinator adds to the ps copies when it takes the
    function's result, so a function run twice (its first worker cut off) adds them once.

    In a worker's ``run`` reply, the header's ``"buffers"`` (`header`) names each delta's
    variable as ``[name, ps]``; the deltas follow the result among the reply's tensors.
    """

    handles: list[VariableHandle]
    deltas: list[torch.Tensor]

    def header(self) -> list[list[Any]]:
        """The variables, as the reply's header names them."""
        return [[h.name, h.ps] for h in self.handles]

    @classmethod
    def from_reply(cls, header: Sequence[Sequence[Any]], deltas: Sequence[torch.Tensor]) -> BufferChanges:
        """The changes a reply carries (``header``: its ``"buffers"``; ``deltas``: the tensors
        after the result).

        Raises:
            ValueError: The header and the tensors do not match.
        """
        if len(header) != len(deltas):
            raise ValueError(
                f"A worker's reply names {len(header)} buffer(s) but carries {len(deltas)} delta(s). "
                "HINT: every task must run the same phalanx version."
            )
        handles = [
            VariableHandle(str(name), int(ps), tuple(d.shape), str(d.dtype), kind="buffer")
            for (name, ps), d in zip(header, deltas, strict=True)
        ]
        return cls(handles, list(deltas))

    def apply(self, ps: PSClient) -> None:
        """Adds the deltas to the ps copies (one RPC per ps task they touch; none if empty)."""
        if self.handles:
            ps.write("assign_add", self.handles, self.deltas)


class PSClient:
    """Reads and writes variables on every ps task: one RPC per ps task per operation, the
    ps tasks in parallel. Thread-safe.

    Args:
        clients: One `RpcClient` per ps task, by index.
    """

    def __init__(self, clients: Sequence[RpcClient]) -> None:
        if not clients:
            raise ValueError("A parameter-server cluster needs at least one ps task. Received: none.")
        self._clients = list(clients)
        self._pool = ThreadPoolExecutor(len(clients), thread_name_prefix="phalanx-ps-client")

    @property
    def num_ps(self) -> int:
        """The number of ps tasks."""
        return len(self._clients)

    def close(self) -> None:
        """Closes every connection."""
        self._pool.shutdown(wait=False)
        for client in self._clients:
            client.close()

    def _per_ps(self, handles: Sequence[VariableHandle]) -> dict[int, list[int]]:
        """Positions of ``handles`` grouped by ps task."""
        groups: dict[int, list[int]] = defaultdict(list)
        for position, handle in enumerate(handles):
            groups[handle.ps].append(position)
        return groups

    def _calls(self, work: Mapping[int, _Call]) -> dict[int, tuple[dict[str, Any], list[torch.Tensor]]]:
        """One call per ps task (``{ps: (method, header, tensors)}``), all sent before any reply
        is awaited, on this thread (`RpcClient.begin`); raises the first error once every call
        that was sent has been answered (so none is left on a connection)."""
        if len(work) < 2 or not all(hasattr(self._clients[ps], "begin") for ps in work):
            return self._each_ps({ps: _bind(self.call, ps, *call) for ps, call in work.items()})
        waits: dict[int, Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]] = {}
        error: BaseException | None = None
        for ps, (method, header, tensors) in work.items():
            try:
                waits[ps] = self._clients[ps].begin(method, header, tensors)
            except Exception as exc:
                error = exc
                break
        replies = {}
        for ps, wait in waits.items():
            try:
                replies[ps] = wait()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return replies

    def _each_ps(self, work: Mapping[int, Callable[[], T]]) -> dict[int, T]:
        """Runs one call per ps task, in parallel (the first on this thread: one thread hop
        less per round); raises the first error."""
        if not work:
            return {}
        (ps, call), *others = work.items()
        futures = {other: self._pool.submit(work_of) for other, work_of in others}
        results = {ps: call()}
        results.update((other, future.result()) for other, future in futures.items())
        return results

    def call(
        self, ps: int, method: str, header: Mapping[str, Any], tensors: Sequence[torch.Tensor] = ()
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """One RPC to ps task ``ps``."""
        return self._clients[ps].call(method, header, tensors)

    # ------------------------------------------------------------------ sharded variables
    @staticmethod
    def _expand(
        handles: Sequence[VariableHandle],
        values: Sequence[torch.Tensor] | None = None,
        split: Callable[[VariableHandle, torch.Tensor], list[torch.Tensor]] = sharding.split_value,
    ) -> tuple[list[VariableHandle], list[torch.Tensor]]:
        """The ps variables behind ``handles`` (shards in place of a sharded one), with
        ``values`` cut the same way."""
        physical: list[VariableHandle] = []
        parts: list[torch.Tensor] = []
        for i, handle in enumerate(handles):
            physical.extend(handle.physical())
            if values is not None:
                parts.extend(split(handle, values[i]) if handle.shards else [values[i]])
        return physical, parts

    @staticmethod
    def _collapse(handles: Sequence[VariableHandle], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The values of ``handles`` from the values of `_expand`'s variables."""
        out, i = [], 0
        for handle in handles:
            n = len(handle.physical())
            out.append(sharding.join_values(handle, values[i : i + n]) if handle.shards else values[i])
            i += n
        return out

    # ------------------------------------------------------------------ variables
    def create(
        self, handles: Sequence[VariableHandle], values: Sequence[torch.Tensor], overwrite: bool = False
    ) -> None:
        """Creates the variables on their ps tasks (idempotent for the same shape and dtype)."""
        handles, values = self._expand(handles, values)
        work = {}
        for ps, pos in self._per_ps(handles).items():
            header = {"names": [handles[i].name for i in pos], "overwrite": overwrite}
            work[ps] = _Call("create", header, [values[i].detach().cpu() for i in pos])
        self._calls(work)

    def read(self, handles: Sequence[VariableHandle]) -> list[torch.Tensor]:
        """The current values, in the order of ``handles``."""
        logical = handles
        handles, _ = self._expand(handles)
        groups = self._per_ps(handles)
        replies = self._calls(
            {ps: _Call("read", {"names": [handles[i].name for i in pos]}) for ps, pos in groups.items()}
        )
        return self._collapse(logical, self._in_order(groups, replies, len(handles)))

    def read_since(
        self, handles: Sequence[VariableHandle], known: Known
    ) -> tuple[dict[int, list[Patch]], dict[str, tuple[str, int]]]:
        """What changed in ``handles`` since a copy of each held the values of ``known`` (by ps
        variable, shards included; one absent, or of a store since restarted, is read whole):
        one ``read_since`` per ps task, which sends only the rows a table's row gradients wrote
        (`VariableStore.changes_since`).

        Returns:
            Per position in ``handles``, the patches that bring such a copy up to date (none:
            unchanged), and what the copies then hold, for the next call's ``known``.

        Raises:
            ValueError: A reply of another phalanx version (an unknown kind of change).
        """
        physical, _ = self._expand(handles)
        owners: list[tuple[int, int | None]] = []  # each ps variable's handle, and its first row there
        for position, handle in enumerate(handles):
            if handle.shards:
                owners.extend((position, start) for start, _ in sharding.rows_of(handle))
            else:
                owners.append((position, None))
        groups = self._per_ps(physical)
        work = {}
        for ps, pos in groups.items():
            names = [physical[i].name for i in pos]
            entries = [known.get(name) for name in names]
            identity = next((entry[0] for entry in entries if entry is not None), None)
            since = [entry[1] if entry is not None and entry[0] == identity else -1 for entry in entries]
            work[ps] = _Call("read_since", {"names": names, "since": since, "identity": identity})
        replies = self._calls(work)
        patches: dict[int, list[Patch]] = defaultdict(list)
        now: dict[str, tuple[str, int]] = {}
        for ps, pos in groups.items():
            header, tensors = replies[ps]
            values = iter(tensors)
            for i, kind in zip(pos, header["kinds"], strict=True):
                now[physical[i].name] = (header["identity"], int(header["version"]))
                position, start = owners[i]
                if kind == "rows":
                    rows, value = next(values), next(values)
                    patches[position].append(Patch(rows if start is None else rows + start, value))
                elif kind == "whole":
                    value = next(values)
                    whole = None if start is None else slice(start, start + value.shape[0])
                    patches[position].append(Patch(whole, value))
                elif kind != "same":
                    raise ValueError(
                        f"A read_since reply names each variable's change 'same', 'rows' or 'whole'. "
                        f"Received: {kind!r} from ps task {ps}. {messages.MESSAGE_HINT}"
                    )
        return dict(patches), now

    def read_rows(self, handle: VariableHandle, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int64, 1-D) of ``handle`` along its first axis, from the shards that
        hold them: an embedding lookup that does not read the whole table."""
        return self.read_changed_and_rows([], {}, handle, rows)[2]

    def write(self, method: str, handles: Sequence[VariableHandle], values: Sequence[torch.Tensor]) -> None:
        """``assign`` or ``assign_add`` of ``values`` to ``handles``."""
        handles, values = self._expand(handles, values)
        work = {}
        for ps, pos in self._per_ps(handles).items():
            header = {"names": [handles[i].name for i in pos]}
            work[ps] = _Call(method, header, [values[i].detach().cpu() for i in pos])
        self._calls(work)

    # ------------------------------------------------------------------ optimizers
    def create_optimizer(
        self,
        key: str,
        optimizer_class: type,
        groups: Sequence[tuple[Sequence[VariableHandle], Mapping[str, Any]]],
    ) -> None:
        """Creates optimizer ``key`` on every ps task over its own variables (idempotent).

        Args:
            key: The optimizer's name on the ps tasks.
            optimizer_class: A ``torch.optim.Optimizer`` subclass.
            groups: Per param group: its variables and its hyperparameters.
        """
        blob = messages.encode_optimizer_class(optimizer_class)
        work = {}
        for ps in range(self.num_ps):
            header = {
                "key": key,
                "optimizer": blob,
                "groups": [
                    {"names": [p.name for h in hs for p in h.physical() if p.ps == ps], **hyper}
                    for hs, hyper in groups
                ],
                "overwrite": False,
            }
            work[ps] = _Call("create_optimizer", header)
        self._calls(work)

    def apply_gradients(
        self,
        key: str,
        handles: Sequence[VariableHandle],
        grads: Sequence[torch.Tensor],
        hyperparameters: Sequence[Mapping[str, Any]] | None,
        return_values: bool = True,
    ) -> tuple[list[torch.Tensor], dict[int, int]]:
        """Each ps task applies the gradients of its variables with optimizer ``key``, atomically.

        Returns:
            The variables' values right after the step (in the order of ``handles``; none
            without ``return_values``), and each ps task's version after it.
        """
        logical = handles
        handles, grads = self._expand(handles, grads, sharding.split_gradient)
        groups = self._per_ps(handles)
        work = {}
        for ps, pos in groups.items():
            header, tensors = messages.encode_gradients(
                [handles[i].name for i in pos], [grads[i] for i in pos]
            )
            header["key"] = key
            header["return_values"] = return_values
            header["hyperparameters"] = (
                None if hyperparameters is None else [dict(h) for h in hyperparameters]
            )
            work[ps] = _Call("apply_gradients", header, tensors)
        replies = self._calls(work)
        versions = {ps: int(r[0]["version"]) for ps, r in replies.items()}
        if not return_values:
            return [], versions
        return self._collapse(logical, self._in_order(groups, replies, len(handles))), versions

    def read_changed(
        self, handles: Sequence[VariableHandle], known: Mapping[int, int]
    ) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
        """Reads ``handles`` from the ps tasks whose version differs from ``known[ps]``.

        Returns:
            The values read, by position in ``handles`` (none for a ps task that did not
            change), and each ps task's current version. A sharded variable is read whole
            whenever it is read (its shards' ps tasks are asked without a known version).
        """
        values, versions, _ = self._read_if_newer(handles, known, None)
        return values, versions

    def read_changed_and_rows(
        self,
        handles: Sequence[VariableHandle],
        known: Mapping[int, int],
        table: VariableHandle,
        rows: torch.Tensor,
    ) -> tuple[dict[int, torch.Tensor], dict[int, int], torch.Tensor]:
        """`read_changed` and `read_rows` of ``table`` in one RPC per ps task: a ps task
        answers both from one snapshot (under its lock), and a step that looks rows up makes
        one read round trip, not two.

        Returns:
            `read_changed`'s values and versions (versions of the ps tasks asked only for
            rows included), and the rows in the order of ``rows``.
        """
        values, versions, looked_up = self._read_if_newer(handles, known, (table, rows.long()))
        assert looked_up is not None
        return values, versions, looked_up

    def _read_if_newer(
        self,
        handles: Sequence[VariableHandle],
        known: Mapping[int, int],
        lookup: tuple[VariableHandle, torch.Tensor] | None,
    ) -> tuple[dict[int, torch.Tensor], dict[int, int], torch.Tensor | None]:
        known = dict(known)
        for handle in handles:
            for shard in handle.shards:
                known[shard.ps] = -1
        physical, _ = self._expand(handles)
        groups = self._per_ps(physical)
        asks = _row_requests(*lookup) if lookup is not None else {}
        work = {}
        for ps in sorted(groups.keys() | asks.keys()):
            header: dict[str, Any] = {"names": [physical[i].name for i in groups.get(ps, [])]}
            header.update(version=known.get(ps, -1), rows=[name for name, _, _ in asks.get(ps, [])])
            work[ps] = _Call("read_if_newer", header, [r for _, r, _ in asks.get(ps, [])])
        replies = self._calls(work)
        values: dict[int, torch.Tensor] = {}
        for ps, pos in groups.items():
            header, tensors = replies[ps]
            if header["changed"]:
                values.update(zip(pos, tensors, strict=False))  # the rows follow the values
        versions = {ps: int(r[0]["version"]) for ps, r in replies.items()}
        looked_up = None if lookup is None else _gather_rows(*lookup, asks, replies)
        return self._collapse_changed(handles, values), versions, looked_up

    def _collapse_changed(
        self, handles: Sequence[VariableHandle], values: Mapping[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        out, i = {}, 0
        for position, handle in enumerate(handles):
            n = len(handle.physical())
            if all(i + k in values for k in range(n)):
                parts = [values[i + k] for k in range(n)]
                out[position] = sharding.join_values(handle, parts) if handle.shards else parts[0]
            i += n
        return out

    @staticmethod
    def _in_order(
        groups: Mapping[int, list[int]],
        replies: Mapping[int, tuple[dict[str, Any], list[torch.Tensor]]],
        n: int,
    ) -> list[torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for ps, pos in groups.items():
            out.update(zip(pos, replies[ps][1], strict=True))
        return [out[i] for i in range(n)]

    def optimizer_state(self, key: str) -> list[dict[str, Any]]:
        """Each ps task's state of optimizer ``key`` (see `phalanx.ps.variable_store.store`)."""
        replies = self._calls({ps: _Call("optimizer_state", {"key": key}) for ps in range(self.num_ps)})
        return [messages.decode_optimizer_state(*replies[ps]) for ps in range(self.num_ps)]

    def load_optimizer_state(self, key: str, states: Sequence[Mapping[str, Any]]) -> None:
        """Restores each ps task's state of optimizer ``key``."""
        work = {}
        for ps in range(self.num_ps):
            header, tensors = messages.encode_optimizer_state(states[ps])
            header["key"] = key
            work[ps] = _Call("load_optimizer_state", header, tensors)
        self._calls(work)


_RowAsk = tuple[str, torch.Tensor, torch.Tensor | slice | None]  # ps variable, its rows, their positions


def _row_requests(table: VariableHandle, rows: torch.Tensor) -> dict[int, list[_RowAsk]]:
    """Per ps task: which of its variables to read ``rows`` of (the shards' own row numbers),
    and where those rows go in the answer (None: all of them, in order)."""
    if not table.shards:
        return {table.ps: [(table.name, rows, None)]}
    asks: dict[int, list[_RowAsk]] = defaultdict(list)
    if rows.numel() > 1 and bool((rows[1:] >= rows[:-1]).all()):  # a lookup's rows (torch.unique)
        bounds = sharding.rows_of(table)
        cuts = torch.searchsorted(rows, torch.tensor([stop for _, stop in bounds[:-1]])).tolist()
        for shard, (start, _), lo, hi in zip(
            table.shards, bounds, [0, *cuts], [*cuts, rows.numel()], strict=True
        ):
            if hi > lo:
                asks[shard.ps].append((shard.name, rows[lo:hi] - start, slice(lo, hi)))
        return asks
    for shard, (start, stop) in zip(table.shards, sharding.rows_of(table), strict=True):
        mine = ((rows >= start) & (rows < stop)).nonzero().flatten()
        if mine.numel():
            asks[shard.ps].append((shard.name, rows[mine] - start, mine))
    return asks


def _gather_rows(
    table: VariableHandle,
    rows: torch.Tensor,
    asks: Mapping[int, list[_RowAsk]],
    replies: Mapping[int, tuple[dict[str, Any], list[torch.Tensor]]],
) -> torch.Tensor:
    """The rows `_row_requests` asked for, from each reply's last tensors, in ``rows``' order."""
    out: torch.Tensor | None = None
    for ps, mine in asks.items():
        tensors = replies[ps][1]
        for (_, _, where), value in zip(mine, tensors[len(tensors) - len(mine) :], strict=True):
            if where is None:
                return value
            if out is None:
                out = torch.empty((rows.numel(), *table.shape[1:]), dtype=table.torch_dtype)
            out[where] = value
    return out if out is not None else torch.empty((0, *table.shape[1:]), dtype=table.torch_dtype)


class _Call(NamedTuple):
    """One call to a ps task."""

    method: str
    header: Mapping[str, Any]
    tensors: Sequence[torch.Tensor] = ()


def _bind(fn: Callable[..., T], *args: Any) -> Callable[[], T]:
    return lambda: fn(*args)
