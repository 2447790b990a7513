"""Safetensors files and Hugging Face folders, read into and written from each worker's shards.

Sources: one ``.safetensors`` file, or a folder holding ``model.safetensors`` or, for a model
in several files, ``model.safetensors.index.json`` (its ``weight_map`` names the file of each
tensor: Hugging Face's layout). Names are the model's ``state_dict()`` keys.

Reading (every worker): a model built on the meta device first gets memory for the shards
the files fill (`phalanx.distribution.loads`); then each worker reads, with safetensors'
slice API, only the rows it keeps of each tensor, in blocks of at most `slices.BLOCK_BYTES`,
and copies them into its shard. A tensor no worker shards (a buffer, a model under a strategy
that does not shard) is read whole and put in with ``load_state_dict``, so the strategy's own
loading applies.

Writing (every worker): the layout (which file, which bytes hold each tensor) follows from
names, shapes and dtypes alone, so every worker computes it alike. The chief writes each
file's header and sizes the file; then every worker writes its own rows of each tensor at
their place (a replicated tensor: one holder writes it) and no worker gathers anything. The
files are made in a temporary folder beside the target and renamed into place by the chief
once every worker is done: a reader sees the whole file (folder) or none. On several machines
the folder must be on a file system every worker writes (as for sharded checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from phalanx.checkpoint import _sharded
from phalanx.checkpoint._files import release_temp_folder
from phalanx.distribution import loads as meta_loads
from phalanx.distribution.slices import (
    BLOCK_BYTES,
    Region,
    byte_runs,
    region_of,
    row_blocks,
    writes_region,
)
from phalanx.state_views import sharded_state_dicts

__all__ = [
    "INDEX",
    "MAX_SHARD_SIZE",
    "SINGLE_FILE",
    "files_of",
    "is_safetensors",
    "load_safetensors",
    "save_safetensors",
]

SUFFIX = ".safetensors"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_SHARD_SIZE = 5 * 10**9  # bytes of tensors per file of a folder (Hugging Face's "5GB")
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _safe_open() -> Any:
    """safetensors' ``safe_open``, or an error that says how to install it."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ImportError(
            "Reading safetensors files needs the safetensors package, which is not installed. "
            "HINT: pip install 'phalanx[safetensors]' (or pip install safetensors)."
        ) from exc
    return safe_open


def is_safetensors(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a safetensors file (by its suffix) or a folder holding
    ``model.safetensors.index.json`` or ``model.safetensors``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return any(os.path.isfile(os.path.join(path, name)) for name in (INDEX, SINGLE_FILE))
    return path.endswith(SUFFIX)


def files_of(path: str | os.PathLike[str]) -> dict[str, str]:
    """``{tensor name: the file that holds it}`` for a safetensors file or folder.

    Raises:
        FileNotFoundError: No such file, or a file the index names is missing (named).
        ValueError: A folder with neither an index nor ``model.safetensors``, or an index
            without a ``weight_map``.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if not os.path.isfile(index):
            single = os.path.join(path, SINGLE_FILE)
            if not os.path.isfile(single):
                raise ValueError(
                    f"{path!r} holds neither {INDEX} nor {SINGLE_FILE}. HINT: pass the .safetensors "
                    "file itself, or the folder a Hugging Face model was saved to."
                )
            return _names_in(single)
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index!r} has no weight_map (tensor name -> file): not a safetensors index.")
        where = {str(name): os.path.join(path, str(file)) for name, file in weight_map.items()}
        for file in sorted(set(where.values())):
            if not os.path.isfile(file):
                name = os.path.basename(file)
                raise FileNotFoundError(f"{index!r} names {name!r}, which is not in {path!r}.")
        return where
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No safetensors file or folder at {path!r}.")
    return _names_in(path)


def _names_in(file: str) -> dict[str, str]:
    with _safe_open()(file, framework="pt") as f:
        return dict.fromkeys(f.keys(), file)


def _targets(module: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Every tensor of ``module``'s state dict once, with all its names (tied weights have
    several), as this worker holds it: shards (DTensors) of a sharded model, nothing gathered."""
    with sharded_state_dicts(), torch.no_grad():
        state = module.state_dict(keep_vars=True)
    named: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            named.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(named.values())


# ---------------------------------------------------------------------------------- reading
def load_safetensors(module: nn.Module, path: str | os.PathLike[str], strict: bool = True) -> None:
    """Loads a safetensors file or folder into ``module`` (all workers; no worker reads more
    than the rows it keeps, a block at a time).

    Args:
        module: The model (built on the meta device or not, sharded or not).
        path: A ``.safetensors`` file or a folder (see the module).
        strict: Whether every tensor of the model must be in the files and every tensor of the
            files in the model (``load_state_dict``'s ``strict``).

    Raises:
        ValueError: ``strict`` and names differ (both lists are given), or a tensor's shape
            differs from the model's (named).
        ImportError: The safetensors package is not installed.
    """
    where = files_of(path)
    meta_loads.prepare(module, where)  # meta layers the files fill get memory, no values
    targets = _targets(module)
    missing = [names[0] for names, _ in targets if not any(n in where for n in names)]
    unexpected = sorted(set(where) - {n for names, _ in targets for n in names})
    if strict and (missing or unexpected):
        raise ValueError(
            f"The safetensors weights at {os.fspath(path)!r} do not match the model's state dict. "
            f"Missing from the files: {missing}. Not in the model: {unexpected}. HINT: the names "
            "are state_dict() keys (load with strict=False to take the tensors both have)."
        )
    with ExitStack() as stack:
        readers: dict[str, Any] = {}

        def reader(file: str) -> Any:
            if file not in readers:
                readers[file] = stack.enter_context(_safe_open()(file, framework="pt"))
            return readers[file]

        whole: dict[str, torch.Tensor] = {}
        held = 0
        for names, target in targets:
            name = next((n for n in names if n in where), None)
            if name is None:
                continue
            piece = reader(where[name]).get_slice(name)
            if tuple(piece.get_shape()) != tuple(target.shape):
                raise ValueError(
                    f"{name!r} has shape {tuple(piece.get_shape())} in {where[name]!r} and "
                    f"{tuple(target.shape)} in the model. HINT: load weights saved from this architecture."
                )
            if isinstance(target, DTensor):
                _read_shard(piece, target)
                continue
            whole[name] = piece[:] if target.dim() else reader(where[name]).get_tensor(name)
            held += target.numel() * target.element_size()
            if held >= BLOCK_BYTES:
                module.load_state_dict(whole, strict=False)
                whole, held = {}, 0
        if whole:
            module.load_state_dict(whole, strict=False)


def _read_shard(piece: Any, target: DTensor) -> None:
    """Copies this worker's rows of one file tensor into its shard of ``target``, a block of
    rows at a time (a shard larger than what a worker can hold twice is never read at once)."""
    region = region_of(target)
    if region.numel == 0:
        return
    with torch.no_grad():
        local = target.to_local()  # the shard itself: written in place
        if not region.sizes:
            local.copy_(piece[:])
            return
        for start, stop in row_blocks(region, local.element_size()):
            local[start:stop].copy_(piece[region.slices((start, stop))])


# ---------------------------------------------------------------------------------- writing
@dataclass
class _File:
    """One file of the output: its name, its tensors and where their bytes start."""

    name: str
    tensors: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)  # (name, tensor, data start)
    size: int = 0  # bytes of tensor data

    def header(self) -> bytes:
        """The safetensors header: its length (8 bytes, little-endian) and JSON padded to 8 bytes."""
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        for name, tensor, start in self.tensors:
            end = start + tensor.numel() * tensor.element_size()
            shape, dtype = list(tensor.shape), DTYPES[tensor.dtype]
            entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
        text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text


def _layout(entries: list[tuple[str, torch.Tensor]], max_shard_size: int, one_file: bool) -> list[_File]:
    """The files and the place of every tensor's bytes: the same on every worker (it depends
    on names, shapes and dtypes only). A folder's files each hold at most ``max_shard_size``
    bytes of tensors (a bigger tensor gets a file of its own)."""
    files: list[_File] = [_File(SINGLE_FILE)]
    for name, tensor in entries:
        size = tensor.numel() * tensor.element_size()
        if not one_file and files[-1].tensors and files[-1].size + size > max_shard_size:
            files.append(_File(""))
        files[-1].tensors.append((name, tensor, files[-1].size))
        files[-1].size += size
    if len(files) > 1:
        for number, file in enumerate(files, 1):
            file.name = f"model-{number:05d}-of-{len(files):05d}{SUFFIX}"
    return files


def _rank() -> int:
    return dist.get_rank() if _sharded._distributed() else 0


def _barrier() -> None:
    if _sharded._distributed():
        dist.barrier()


def save_safetensors(
    module: nn.Module, path: str | os.PathLike[str], max_shard_size: int = MAX_SHARD_SIZE
) -> str:
    """Writes ``module``'s state dict as safetensors (all workers; each writes its own rows).

    Args:
        module: The model (sharded or not).
        path: A path ending in ``.safetensors`` (one file), or a folder: ``model.safetensors``
            if the tensors fit ``max_shard_size``, else ``model-0000k-of-0000n.safetensors``
            files and ``model.safetensors.index.json`` (Hugging Face's layout). An existing
            file or folder of that name is replaced.
        max_shard_size: The most bytes of tensors per file of a folder.

    Returns:
        ``path``.

    Raises:
        ValueError: A tensor's dtype has no safetensors name (complex numbers), or
            ``max_shard_size`` is not positive.
    """
    path = os.fspath(path)
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes. Received: {max_shard_size}.")
    with sharded_state_dicts(), torch.no_grad():  # values: every worker reads each in the same order
        values = module.state_dict()  # (a strategy's variables aggregate on read: a collective)
    entries = [(names[0], values[names[0]]) for names, _ in _targets(module)]  # tied weights once
    odd = sorted({str(t.dtype) for _, t in entries if t.dtype not in DTYPES})
    if odd:
        raise ValueError(
            f"safetensors has no name for dtype(s) {odd}. HINT: save this model with "
            "phalanx.checkpoint.Checkpoint, or convert those tensors first."
        )
    one_file = path.endswith(SUFFIX)
    files = _layout(entries, max_shard_size, one_file)
    temp, lock = _sharded._temp_folder(path)
    try:
        if lock is not None:  # the chief
            for file in files:
                _create(os.path.join(temp, file.name), file)
        _barrier()  # every file exists at its full size
        for file in files:
            _write_rows(os.path.join(temp, file.name), file)
        _barrier()  # every worker's rows are in
        if lock is not None:
            if len(files) > 1:
                _write_index(temp, files)
            _publish(temp, path, lock, files, one_file)
            lock = None
    finally:
        if lock is not None:
            os.close(lock)  # a failed save: the next one in the folder removes the folder
    _barrier()  # nobody reads before the rename
    return path


def _create(file_path: str, file: _File) -> None:
    """The chief: the file with its header, sized to hold every tensor (zeros until written)."""
    header = file.header()
    with open(file_path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + file.size)


def _write_rows(file_path: str, file: _File) -> None:
    """Writes this worker's part of every tensor of ``file`` at its place, a block of rows at a time."""
    rank = _rank()
    mine = [(tensor, start) for _, tensor, start in file.tensors if writes_region(tensor, rank)]
    if not mine:  # a worker that holds nothing of its own here (a model no strategy shards)
        return
    data_start = len(file.header())
    fd = os.open(file_path, os.O_WRONLY)
    try:
        for tensor, start in mine:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            _write_region(fd, data_start + start, region_of(tensor), local.detach())
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_region(fd: int, start: int, region: Region, local: torch.Tensor) -> None:
    """Writes ``local`` (the tensor's ``region``) into the row-major tensor whose bytes start at ``start``."""
    if region.numel == 0:
        return
    itemsize = local.element_size()
    if not region.sizes:
        _pwrite(fd, _bytes(local.reshape(1)), start)
        return
    for first, stop in row_blocks(region, itemsize):
        block = Region(
            region.shape, (region.offsets[0] + first, *region.offsets[1:]), (stop - first, *region.sizes[1:])
        )
        data = _bytes(local[first:stop])
        for at, offset, length in byte_runs(block):
            _pwrite(fd, data[offset * itemsize : (offset + length) * itemsize], start + at * itemsize)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` in row-major order, on the CPU (a view where it is already so)."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return memoryview(flat.view(torch.uint8).numpy().data).cast("B")


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _write_index(folder: str, files: list[_File]) -> None:
    weight_map = {name: file.name for file in files for name, _, _ in file.tensors}
    index = {"metadata": {"total_size": sum(file.size for file in files)}, "weight_map": weight_map}
    with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)


def _publish(temp: str, path: str, lock: int, files: list[_File], one_file: bool) -> None:
    """The chief puts the finished output in place: the file, or the whole folder."""
    if not one_file:
        _sharded._publish(temp, path, lock)
        return
    written = os.path.join(temp, files[0].name)
    fd = os.open(written, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(written, path)
    release_temp_folder(lock, temp)
    shutil.rmtree(temp, ignore_errors=True)
