"""Checkpoint: save and restore a group of stateful objects (tf.train.Checkpoint)."""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch

from phalanx.checkpoint import _sharded, _sharded_state
from phalanx.checkpoint._files import safe_load
from phalanx.checkpoint._index import latest_checkpoint, record_checkpoint
from phalanx.checkpoint._objects import load_into, state_of
from phalanx.checkpoint.options import CheckpointOptions, CheckpointWriter
from phalanx.checkpoint.weights import safetensors_files
from phalanx.communication.compression.base import checkpoint_restored

__all__ = ["Checkpoint", "Counter"]

FORMAT = "phalanx.checkpoint/1"


class Counter:
    """A saveable integer (a step or epoch counter) for `Checkpoint`."""

    def __init__(self, value: int = 0) -> None:
        self.value = int(value)

    def assign(self, value: int) -> None:
        self.value = int(value)

    def assign_add(self, delta: int = 1) -> int:
        self.value += int(delta)
        return self.value

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"Counter({self.value})"

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])


class Checkpoint:
    """Groups stateful objects under names and writes them to one file, atomically.

    Objects: modules, `phalanx.Model`s, optimizers, metrics, LR schedulers, `Counter`s,
    tensors, and anything with ``state_dict``/``load_state_dict`` (e.g. a data-iterator
    position). Values of sync-on-read variables are saved aggregated, so a checkpoint
    written under one strategy restores under any other. Every worker calls ``save``
    (all workers); only the chief's file is kept.

    Args:
        **objects: name -> object.
    """

    save_counter: Counter  # how many times `save` ran (restored with the checkpoint)

    def __init__(self, **objects: Any) -> None:
        if not objects:
            raise ValueError("Checkpoint needs at least one object: Checkpoint(model=model, ...).")
        self._objects = objects
        self.save_counter = Counter(0)
        self._writer = CheckpointWriter()

    def _payload(self) -> dict[str, Any]:
        return {"format": FORMAT, "save_counter": self.save_counter.value, "objects": self.state_dict()}

    @property
    def is_sharded(self) -> bool:
        """Whether a tracked module is sharded (FullyShardedStrategy's DTensors): then `write`
        and `save` write the sharded format unless told otherwise."""
        return _sharded_state.is_sharded(self._objects)

    def state_dict(self) -> dict[str, Any]:
        """Every tracked object's state, by name, in memory (what a single-file save writes
        of them; the save counter is not in it). The chief of an elastic job hands it to new
        members (`phalanx.checkpoint.failure_handling`)."""
        return {name: state_of(obj) for name, obj in self._objects.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a `state_dict` into the tracked objects, by name.

        Raises:
            KeyError: ``state`` lacks a tracked object's name.
        """
        for name, obj in self._objects.items():
            load_into(obj, state[name], name)

    def write(
        self,
        file_path: str,
        options: CheckpointOptions | None = None,
        sharded: bool | None = None,
        blocking: bool = True,
    ) -> Any:
        """Writes every object's state to ``file_path`` (no counter added).

        Args:
            file_path: The file (single-file format) or folder (sharded: ``.dcp``) to write.
            options: TF's `CheckpointOptions`; ``enable_async=True`` writes a single-file
                checkpoint in the background (`sync` waits for it).
            sharded: Write a sharded checkpoint through ``torch.distributed.checkpoint``:
                one copy of the state in total, each worker writing its own part, restorable
                at any world size. Default: when a module is sharded (FullyShardedStrategy),
                or when not blocking.
            blocking: False returns as soon as the state is staged in memory (sharded only):
                a `concurrent.futures.Future` that gives the path once the files are in place.

        Returns:
            The path, or (not blocking) a future of it.

        Raises:
            ValueError: ``blocking=False`` with ``sharded=False``.
        """
        from phalanx.strategies.default import get_strategy  # here: serving imports no strategy

        strategy = get_strategy()
        if sharded is None:
            sharded = not blocking or self.is_sharded
        if not sharded:
            if not blocking:
                raise ValueError(
                    "An asynchronous save writes a sharded checkpoint. Received: sharded=False, "
                    "blocking=False. HINT: leave sharded unset, save with blocking=True, or pass "
                    "CheckpointOptions(enable_async=True) for a single file written in the background."
                )
            self._writer.write(self._payload(), file_path, options, strategy)
            return file_path
        state = _sharded_state.collect(self._objects, strategy)
        state["format"], state["save_counter"] = _sharded_state.FORMAT, self.save_counter.value
        future: Future[str] | None = _sharded.save(state, file_path, blocking)
        return file_path if future is None else future

    def save(
        self,
        file_prefix: str,
        options: CheckpointOptions | None = None,
        sharded: bool | None = None,
        blocking: bool = True,
    ) -> Any:
        """Writes to ``{file_prefix}-{n}.pt`` (sharded: the folder ``{file_prefix}-{n}.dcp``)
        with n the save counter (incremented first), and lists it in the folder's index, so
        ``latest_checkpoint(folder)`` finds it (as TF); see `write` for the options."""
        self.save_counter.assign_add(1)
        folder = sharded if sharded is not None else not blocking or self.is_sharded
        suffix = _sharded.SUFFIX if folder else ".pt"
        path = f"{file_prefix}-{self.save_counter.value}{suffix}"
        written = self.write(path, options, folder, blocking)
        record_checkpoint(path)
        return written

    def sync(self) -> None:
        """Waits until a background write (``enable_async``) is on disk; at once otherwise.

        Raises:
            TimeoutError: The write did not finish within an hour (the path is named).
            Exception: The background write's error.
        """
        self._writer.sync()

    def read(self, save_path: str, options: CheckpointOptions | None = None) -> Checkpoint:
        """Restores every object saved under the same name; from a safetensors file or Hugging
        Face folder, the weights of the one model this checkpoint tracks (each worker of a
        sharded model reading only its rows).

        Raises:
            FileNotFoundError: No such checkpoint.
            ValueError: The file is not a phalanx checkpoint, or lacks one of the objects; a
                safetensors source given a checkpoint that tracks more than one model.
        """
        self._writer.sync()  # the file may be one this checkpoint is still writing
        if safetensors_files.is_safetensors(save_path):
            return self._read_weights(save_path)
        if _sharded.is_sharded(save_path):
            return self._read_sharded(save_path)
        payload = safe_load(save_path)
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise ValueError(f"{save_path!r} is not a phalanx checkpoint (format {FORMAT}).")
        saved = payload["objects"]
        missing = sorted(set(self._objects) - set(saved))
        if missing:
            raise ValueError(
                f"Checkpoint {save_path!r} has no state for {missing}; it holds {sorted(saved)}."
            )
        skip_slots = options is not None and options.experimental_skip_slot_variables
        for name, obj in self._objects.items():
            if skip_slots and isinstance(obj, torch.optim.Optimizer):
                continue  # TF's slot variables are the optimizer's state
            load_into(obj, saved[name], name)
        self.save_counter.assign(payload.get("save_counter", 0))
        checkpoint_restored()
        return self

    def _read_weights(self, save_path: str) -> Checkpoint:
        """The one model's weights from safetensors (which hold nothing else)."""
        modules = {name: getattr(obj, "module", obj) for name, obj in self._objects.items()}
        models = [m for m in modules.values() if isinstance(m, torch.nn.Module)]
        if len(models) != 1 or len(modules) != 1:
            raise ValueError(
                f"{save_path!r} holds one model's weights (safetensors), and this Checkpoint tracks "
                f"{sorted(self._objects)}. HINT: read it with a Checkpoint of the model alone, "
                "Checkpoint(model=model).read(path), and restore the rest from a phalanx checkpoint."
            )
        safetensors_files.load_safetensors(models[0], save_path)
        return self

    def _read_sharded(self, save_path: str) -> Checkpoint:
        from phalanx.strategies.default import get_strategy  # here: serving imports no strategy

        strategy = get_strategy()
        _sharded_state.prepare(self._objects, _sharded.saved_keys(save_path))
        state = _sharded_state.collect(self._objects, strategy)
        state["format"], state["save_counter"] = "", 0

        def apply(loaded: dict[str, Any]) -> None:
            if loaded["format"] != _sharded_state.FORMAT:
                raise ValueError(
                    f"{save_path!r} is not a phalanx checkpoint (format {_sharded_state.FORMAT})."
                )
            _sharded_state.apply(self._objects, loaded, strategy)
            self.save_counter.assign(loaded["save_counter"])

        try:
            _sharded.load(state, save_path, apply)
        except (KeyError, RuntimeError) as exc:
            if "Missing key" not in str(exc) and not isinstance(exc, KeyError):
                raise
            raise ValueError(f"Checkpoint {save_path!r} lacks state for these objects: {exc}") from exc
        checkpoint_restored()
        return self

    def restore(self, save_path: str | None, options: CheckpointOptions | None = None) -> Checkpoint:
        """`read`, accepting a directory (its latest checkpoint) or None (nothing to restore)."""
        if save_path is None:
            return self
        folder = os.path.isdir(save_path) and not _sharded.is_sharded(save_path)
        if folder and not safetensors_files.is_safetensors(save_path):
            latest = latest_checkpoint(save_path)
            if latest is None:
                raise FileNotFoundError(f"No checkpoint in directory {save_path!r}.")
            save_path = latest
        return self.read(save_path, options)
