"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): one copy of the state in
total, each worker writing its own part, restorable under any strategy at any world size.

A sharded checkpoint is a folder (``<prefix>-<n>.dcp``) holding DCP's files: one
``__<rank>_0.distcp`` per worker and ``.metadata``. Every worker writes into a temporary
folder beside it (``.tmp-phalanx-dcp-...``, its name chosen by the chief); once DCP's last
step (the chief writing ``.metadata`` after every worker reported its files) is done, the
chief renames the folder into place: a reader sees the whole checkpoint or none. The folder
must be one that every worker can write (a shared file system on several machines). The chief
holds a lock on a file in the temporary folder until the rename; a temporary folder nobody
holds the lock of, older than the current save, is a killed save's, and the chief removes it
(`phalanx.checkpoint._files.remove_stale_temp_folders`).

An asynchronous save copies the state into a staging copy kept for the next save (DCP's
staging cache: later saves copy without allocating), then writes and renames on DCP's thread.

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
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.tensor import DTensor

from phalanx.checkpoint._files import (
    TEMP_FOLDER_PREFIX,
    locked_temp_folder,
    release_temp_folder,
    remove_stale_temp_folders,
)

__all__ = ["SUFFIX", "SafeLoadPlanner", "SafeMetadataReader", "is_sharded", "load", "save", "saved_keys"]

SUFFIX = ".dcp"
STAGING_WAIT_SECONDS = 3600.0  # how long a save waits for the previous one to free the staging copy
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


def saved_keys(path: str) -> set[str]:
    """The flattened keys of what the sharded checkpoint at ``path`` holds (``model.layer.weight``).

    Raises:
        ValueError: The metadata cannot be read (as `load` says it).
    """
    try:
        metadata = SafeMetadataReader(path).read_metadata()
    except Exception as exc:  # what DCP's load would report, reported as `load` does
        raise ValueError(f"Cannot restore the sharded checkpoint {path!r}: {exc}") from exc
    return {str(key) for key in metadata.state_dict_metadata}


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


def _temp_folder(path: str) -> tuple[str, int | None]:
    """A temporary folder beside ``path`` whose name every worker agrees on (the chief's), and
    the descriptor of its lock (the chief's; None elsewhere). The chief first removes what
    killed saves left in that folder."""
    folder = os.path.dirname(os.path.abspath(path))
    chief = not _distributed() or dist.get_rank() == 0
    name, lock = [f"{TEMP_FOLDER_PREFIX}{uuid.uuid4().hex[:12]}"], None
    if chief:
        os.makedirs(folder, exist_ok=True)
        remove_stale_temp_folders(folder, before=time.time())
        lock = locked_temp_folder(folder, name[0])
    if _distributed():
        dist.broadcast_object_list(name, src=0)
    temp = os.path.join(folder, str(name[0]))
    os.makedirs(temp, exist_ok=True)  # on another machine's view of a shared file system
    return temp, lock


def _publish(temp: str, path: str, lock: int | None) -> None:
    """The chief (the holder of the lock) renames the finished folder into place (an older
    one of that name goes), then lets the lock go."""
    if lock is None:
        return
    for name in os.listdir(temp):  # DCP closes its files; make them durable before the rename
        fd = os.open(os.path.join(temp, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(temp, path)  # the name is no temporary folder's any more: no cleaner takes it
    release_temp_folder(lock, path)


def _let_go(lock: int | None) -> None:
    """A failed save's lock: the next save in the folder removes the folder."""
    if lock is not None:
        with contextlib.suppress(OSError):
            os.close(lock)


_async_group: Any = None


def _background_group() -> Any:
    """A gloo group of every worker for asynchronous saves' own collectives (made once, by
    every worker at its first asynchronous save): the training's collectives keep theirs."""
    global _async_group
    if _async_group is None and _distributed():
        _async_group = dist.new_group(backend="gloo")
    return _async_group


class _CachedStager(BlockingAsyncStager):
    """DCP's blocking stager with its cache, which on a machine without an accelerator it
    cannot make (it pins the copy's memory: "Cannot access accelerator device"). The helpers
    are DCP's own (private in torch 2.13, which phalanx pins)."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self.state_dict_cache)


class _Staging:
    """The staging copy of asynchronous saves, kept from one save to the next (DCP's
    ``cache_staged_state_dict``): staging then only copies the state into it, where a new copy
    would first allocate (and fault in) the whole state. One copy per process, for the last
    layout of state saved; a save of another layout replaces it. The copy is reused only
    once the save that last wrote from it finished."""

    def __init__(self) -> None:
        self._layout: tuple[Any, ...] | None = None
        self._stager: BlockingAsyncStager | None = None
        self._writing: Future[Any] | None = None

    def stager(self, state: dict[str, Any]) -> BlockingAsyncStager:
        layout = _layout(state)
        if self._writing is not None:  # an earlier save still reads the copy: it finishes first
            done, _ = futures.wait([self._writing], timeout=STAGING_WAIT_SECONDS)
            if not done:  # its own error, if it fails, reaches its caller through its future
                raise TimeoutError(
                    f"An asynchronous sharded save waited {STAGING_WAIT_SECONDS:g} s for the previous "
                    "one, which still writes from the staging copy, to finish. HINT: check that the "
                    "checkpoint folder's file system responds; call result() on a save's future "
                    "before the next save to see its error."
                )
            self._writing = None
        if self._stager is None or layout != self._layout:
            self._layout, self._stager = layout, _CachedStager(cache_staged_state_dict=True)
        return self._stager

    def writing(self, future: Future[Any]) -> None:
        self._writing = future


def _layout(value: Any) -> Any:
    """What the staging copy must match: the nested keys, and every tensor's local shape and dtype."""
    if isinstance(value, Mapping):
        return tuple((key, _layout(item)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return tuple(_layout(item) for item in value)
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device.type)
    return type(value)


_staging = _Staging()


def save(state: dict[str, Any], path: str, blocking: bool = True) -> Future[str] | None:
    """Writes ``state`` (DTensors: each worker its shards) as a sharded checkpoint at ``path``.

    Every worker calls it. Blocking: returns once the folder is in place. Otherwise returns
    a future as soon as the state is staged (copied to memory); the writing and the rename
    happen in the background and the future gives ``path`` when they are done.
    """
    temp, lock = _temp_folder(path)
    writer = dcp.FileSystemWriter(temp, sync_files=True)
    try:
        if blocking:
            _save_now(state, writer)
            _publish(temp, path, lock)
            if _distributed():
                dist.barrier()  # nobody reads before the rename
            return None
        staged = _save_in_background(state, writer)
    except BaseException:
        _let_go(lock)
        raise
    done: Future[str] = Future()

    def finish(written: Future[Any]) -> None:
        try:
            written.result()
            _publish(temp, path, lock)
            done.set_result(path)
        except BaseException as exc:  # the caller sees it from result()
            _let_go(lock)
            done.set_exception(exc)

    staged.add_done_callback(finish)
    return done


def _save_now(state: dict[str, Any], writer: dcp.FileSystemWriter) -> None:
    with _quiet_without_group():
        dcp.save(state, storage_writer=writer, no_dist=not _distributed())
    if _distributed():
        dist.barrier()  # every worker's files are written (the chief's metadata last)


def _save_in_background(state: dict[str, Any], writer: dcp.FileSystemWriter) -> Future[Any]:
    group = _background_group()
    stager = _staging.stager(state)
    with _quiet_without_group():
        staged = dcp.async_save(
            state, storage_writer=writer, process_group=group, no_dist=group is None, async_stager=stager
        )
    _staging.writing(staged)  # type: ignore[arg-type]
    return staged  # type: ignore[return-value]


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
