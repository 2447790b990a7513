"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): one copy of the state in
total, each worker writing its own part, restorable under any strategy at any world size.

A sharded checkpoint is a folder (``<prefix>-<n>.dcp``) holding DCP's files: one
``__<rank>_0.distcp`` per worker and ``.metadata``. Every worker writes into a temporary
folder beside it (``.tmp-phalanx-dcp-...``, its name chosen by the chief); once DCP's last
step (the chief writing ``.metadata`` after every worker reported its files) is done, the
chief renames the folder into place: a reader sees the whole checkpoint or none. The folder
must be one that every worker can write (a shared file system on several machines).

DCP's ``.metadata`` is a pickle, and DCP loads non-tensor values with
``torch.load(weights_only=False)``: both would run code for whoever wrote the folder.
phalanx reads the metadata with an unpickler that builds only DCP's own metadata classes and
a few torch and builtin types (anything else is refused, see `SafeMetadataReader`), and
loads non-tensor values with ``weights_only=True`` (`SafeLoadPlanner`).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from phalanx.checkpoint._files import TEMP_PREFIX

__all__ = ["SUFFIX", "SafeLoadPlanner", "SafeMetadataReader", "is_sharded", "load", "save"]

SUFFIX = ".dcp"
METADATA = ".metadata"

# What DCP's metadata pickle may build: its own metadata classes and the plain types in them.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("torch.serialization", "_get_layout"),  # torch.strided etc. by name, from torch's table
    ("torch", "device"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)  # torch.float32 etc., by name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"A checkpoint's DCP metadata asks for {module}.{name}, which is not part of DCP's "
            "metadata: phalanx refuses to build it (it could run code). HINT: restore only "
            "checkpoints written by phalanx or torch.distributed.checkpoint."
        )


class SafeMetadataReader(dcp.FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` without running code (see module)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The folder's metadata, built only from DCP's metadata classes.

        Raises:
            pickle.UnpicklingError: The metadata asks for anything else (it is named).
        """
        with open(os.path.join(self.path, METADATA), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"{self.path!r}: {METADATA} does not hold DCP metadata "
                f"(it holds a {type(metadata).__name__})."
            )
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Stores one non-tensor value (an int, a string, a list of them...)."""
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # DCP's own helper

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def is_sharded(path: str) -> bool:
    """Whether ``path`` is a sharded (DCP) checkpoint folder."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


@contextlib.contextmanager
def _quiet_without_group() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialised: that
    is the intent here (one device, Mirrored), not a mistake to report."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _temp_folder(path: str) -> str:
    """A temporary folder beside ``path`` whose name every worker agrees on (the chief's)."""
    name = [f"{TEMP_PREFIX}dcp-{uuid.uuid4().hex[:12]}"]
    if _distributed():
        dist.broadcast_object_list(name, src=0)
    return os.path.join(os.path.dirname(os.path.abspath(path)), str(name[0]))


def _publish(temp: str, path: str) -> None:
    """The chief (rank 0) renames the finished folder into place (an older one of that name goes)."""
    if _distributed() and dist.get_rank() != 0:
        return
    for name in os.listdir(temp):  # DCP closes its files; make them durable before the rename
        fd = os.open(os.path.join(temp, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(temp, path)


_async_group: Any = None


def _background_group() -> Any:
    """A gloo group of every worker for asynchronous saves' own collectives (made once, by
    every worker at its first asynchronous save): the training's collectives keep theirs."""
    global _async_group
    if _async_group is None and _distributed():
        _async_group = dist.new_group(backend="gloo")
    return _async_group


def save(state: dict[str, Any], path: str, blocking: bool = True) -> Future[str] | None:
    """Writes ``state`` (DTensors: each worker its shards) as a sharded checkpoint at ``path``.

    Every worker calls it. Blocking: returns once the folder is in place. Otherwise returns
    a future as soon as the state is staged (copied to memory); the writing and the rename
    happen in the background and the future gives ``path`` when they are done.
    """
    temp = _temp_folder(path)
    os.makedirs(temp, exist_ok=True)
    writer = dcp.FileSystemWriter(temp, sync_files=True)
    if blocking:
        with _quiet_without_group():
            dcp.save(state, storage_writer=writer, no_dist=not _distributed())
        if _distributed():
            dist.barrier()  # every worker's files are written (the chief's metadata last)
        _publish(temp, path)
        if _distributed():
            dist.barrier()  # nobody reads before the rename
        return None
    group = _background_group()
    with _quiet_without_group():
        staged = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=group is None)
    done: Future[str] = Future()

    def finish(written: Future[Any]) -> None:
        try:
            written.result()
            _publish(temp, path)
            done.set_result(path)
        except BaseException as exc:  # the caller sees it from result()
            done.set_exception(exc)

    staged.add_done_callback(finish)  # type: ignore[union-attr]
    return done


def load(state: dict[str, Any], path: str, apply: Callable[[dict[str, Any]], None]) -> None:
    """Reads the sharded checkpoint at ``path`` into ``state`` (in place: each worker reads
    what its tensors hold, whatever world size wrote it), then calls ``apply(state)``.

    Raises:
        ValueError: The folder cannot be read: its metadata asks for a class that is not
            DCP's (named), it lacks an entry of ``state``, or a file is damaged.
    """
    try:
        reader, planner = SafeMetadataReader(path), SafeLoadPlanner()
        with _quiet_without_group():
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not _distributed())
    except CheckpointException as exc:  # a BaseException: say why, as an error callers catch
        causes = [getattr(f, "exception", f) for f in exc.failures.values()]
        raise ValueError(
            f"Cannot restore the sharded checkpoint {path!r}: {causes[0] if causes else exc}"
        ) from exc
    apply(state)
