"""Crafted checkpoint indexes and temp files: nothing outside the folder is read or deleted.

Each test keeps a sentinel outside the checkpoint folder: a valid phalanx checkpoint with
weights of its own. That it still exists with the same bytes proves nothing deleted or wrote
it; that the model keeps its own weights proves nothing read it into the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint
from phalanx.checkpoint._files import FOLDER_LOCK, TEMP_FOLDER_PREFIX, TEMP_PREFIX, atomic_save

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def sentinel(tmp_path):
    """An outside checkpoint (all weights 7) and its bytes; checked after the test."""
    outside = tmp_path / "outside"
    outside.mkdir()
    path = outside / "ckpt-1.pt"
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(7.0)
        model.bias.fill_(7.0)
    Checkpoint(model=model).write(str(path))
    content = path.read_bytes()
    yield path
    assert path.exists(), "a file outside the checkpoint folder was deleted"
    assert path.read_bytes() == content, "a file outside the checkpoint folder was changed"


def _folder(tmp_path, entries):
    folder = tmp_path / "ckpts"
    folder.mkdir(exist_ok=True)
    (folder / "checkpoint.json").write_text(json.dumps({"checkpoints": entries}))
    return folder


def _crafted(tmp_path, sentinel, kind):
    """A checkpoint folder whose index names the sentinel in one way an attacker could."""
    if kind == "absolute":
        return _folder(tmp_path, [str(sentinel)])
    if kind == "dotdot":
        return _folder(tmp_path, ["../outside/ckpt-1.pt"])
    if kind == "separator":
        return _folder(tmp_path, ["sub/ckpt-1.pt"])
    if kind == "symlink-out":
        folder = _folder(tmp_path, ["ckpt-1.pt"])
        (folder / "ckpt-1.pt").symlink_to(sentinel)
        return folder
    if kind == "index-symlink-out":
        folder = tmp_path / "ckpts"
        folder.mkdir()
        listing = tmp_path / "outside" / "index.json"
        listing.write_text(json.dumps({"checkpoints": ["ckpt-1.pt"]}))
        (folder / "checkpoint.json").symlink_to(listing)
        return folder
    raise AssertionError(kind)


KINDS = ["absolute", "dotdot", "separator", "symlink-out", "index-symlink-out"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_crafted_index_is_refused_and_nothing_outside_is_read_or_deleted(tmp_path, sentinel, kind):
    folder = _crafted(tmp_path, sentinel, kind)
    model = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rule = r"The checkpoint index .*checkpoint\.json (may list only|must be a file).* Received: .* HINT: "
    with pytest.raises(ValueError, match=rule):
        CheckpointManager(Checkpoint(model=model), str(folder), max_to_keep=1)
    with pytest.raises(ValueError, match=rule):
        latest_checkpoint(str(folder))
    with pytest.raises(ValueError, match=rule):
        Checkpoint(model=model).restore(str(folder))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], msg=key)  # the sentinel's 7s were never read


def test_the_index_of_another_manager_is_refused_and_its_files_kept(tmp_path, sentinel):
    folder = tmp_path / "ckpts"
    other = CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), str(folder), checkpoint_name="other")
    theirs = other.save()
    with pytest.raises(ValueError, match=r"only plain names of this manager's checkpoints \('ckpt-<n>\.pt'"):
        CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), str(folder), max_to_keep=1)
    assert os.path.exists(theirs)
    assert latest_checkpoint(str(folder)) == theirs  # inside the folder: the free function may read it


def test_a_link_that_stays_inside_the_folder_is_accepted(tmp_path):
    folder = tmp_path / "ckpts"
    manager = CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), str(folder))
    real = manager.save()
    os.rename(real, folder / "kept.pt")
    os.symlink(folder / "kept.pt", real)
    again = CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), str(folder))
    assert again.latest_checkpoint == real


def test_save_never_deletes_through_a_link_planted_after_the_index_was_read(tmp_path, sentinel):
    folder = tmp_path / "ckpts"
    manager = CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), str(folder), max_to_keep=1)
    first = manager.save()
    os.remove(first)
    os.symlink(sentinel, first)  # the next save removes the oldest: the link goes, not its target
    manager.save()
    assert not os.path.lexists(first)


def _stale(folder: Path, name: str, age: float = 60.0) -> Path:
    path = folder / name
    path.write_bytes(b"x" * 1000)
    past = time.time() - age
    os.utime(path, (past, past))
    return path


def test_an_interrupted_saves_temp_file_is_removed_by_the_next_save_and_nothing_else(tmp_path, sentinel):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    stale = _stale(folder, f"{TEMP_PREFIX}abcd_123")
    kept = [
        _stale(folder, f"{TEMP_PREFIX}ABCD_123"),  # not mkstemp's alphabet
        _stale(folder, f"{TEMP_PREFIX}abcd_1234"),  # one character too many
        _stale(folder, ".tmp-abcd_123"),  # another program's temp file
        _stale(folder, "notes.txt"),
    ]
    link = folder / f"{TEMP_PREFIX}zzzzzzzz"
    link.symlink_to(sentinel)
    atomic_save({"a": 1}, str(folder / "model.pt"))
    assert not stale.exists()
    assert all(path.exists() for path in kept)
    assert link.is_symlink()  # a link is never followed nor removed


def test_a_temp_file_newer_than_the_save_is_left_alone(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    fresh = _stale(folder, f"{TEMP_PREFIX}abcd_123", age=-3600)  # modified after this save began
    atomic_save({"a": 1}, str(folder / "model.pt"))
    assert fresh.exists()


_WRITER = """
import sys, time
from phalanx.checkpoint._files import _locked_temp_file
fd, path = _locked_temp_file(sys.argv[1])
print(path, flush=True)
time.sleep(120)
"""


def test_a_live_writers_temp_file_is_kept_and_a_killed_writers_removed(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC}
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(folder)], stdout=subprocess.PIPE, env=env)
    try:
        temp = Path(writer.stdout.readline().decode().strip())
        past = time.time() - 60
        os.utime(temp, (past, past))  # old enough: only its writer's lock protects it
        atomic_save({"a": 1}, str(folder / "model.pt"))
        assert temp.exists()
    finally:
        writer.kill()
        writer.wait(timeout=30)
        writer.stdout.close()
    atomic_save({"a": 2}, str(folder / "model.pt"))
    assert not temp.exists()


_SAVER = """
import sys, torch
from phalanx.checkpoint._files import atomic_save
folder, me = sys.argv[1], sys.argv[2]
for i in range(40):
    atomic_save({"i": torch.full((1000,), i)}, f"{folder}/{me}-{i % 3}.pt")
    atomic_save({"i": i}, f"{folder}/shared.pt")
"""


def test_two_processes_saving_to_one_folder_never_remove_each_others_files(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC}
    savers = [
        subprocess.Popen([sys.executable, "-c", _SAVER, str(folder), name], stderr=subprocess.PIPE, env=env)
        for name in ("a", "b")
    ]
    for saver in savers:
        _, err = saver.communicate(timeout=120)
        assert saver.returncode == 0, err.decode()
    assert sorted(os.listdir(folder)) == [
        "a-0.pt",
        "a-1.pt",
        "a-2.pt",
        "b-0.pt",
        "b-1.pt",
        "b-2.pt",
        "shared.pt",
    ]


def _stale_folder(folder: Path, name: str, age: float = 60.0, lock_file: bool = True) -> Path:
    path = folder / name
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"x" * 1000)
    if lock_file:
        (path / FOLDER_LOCK).write_bytes(b"")
    past = time.time() - age
    os.utime(path, (past, past))
    return path


_FOLDER_WRITER = """
import sys, time
from phalanx.checkpoint._files import locked_temp_folder
fd = locked_temp_folder(sys.argv[1], sys.argv[2])
print("locked", flush=True)
time.sleep(120)
"""


def test_a_killed_sharded_saves_folder_is_removed_by_the_next_save_and_nothing_else(tmp_path, sentinel):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    stale = [
        _stale_folder(folder, f"{TEMP_FOLDER_PREFIX}0123456789ab"),  # its lock file, unlocked
        _stale_folder(folder, f"{TEMP_FOLDER_PREFIX}ba9876543210", lock_file=False),  # killed before it
    ]
    kept = [
        _stale_folder(folder, f"{TEMP_FOLDER_PREFIX}0123456789AB"),  # not the 12 hex digits we write
        _stale_folder(folder, f"{TEMP_FOLDER_PREFIX}0123456789abc"),  # one too many
        _stale_folder(folder, f"{TEMP_FOLDER_PREFIX}aaaaaaaaaaaa", age=-3600),  # newer than the save
        _stale_folder(folder, "model-1.dcp"),
    ]
    link = folder / f"{TEMP_FOLDER_PREFIX}cccccccccccc"
    link.symlink_to(sentinel.parent)  # a folder outside
    env = {**os.environ, "PYTHONPATH": SRC}
    live_name = f"{TEMP_FOLDER_PREFIX}dddddddddddd"
    writer = subprocess.Popen(
        [sys.executable, "-c", _FOLDER_WRITER, str(folder), live_name], stdout=subprocess.PIPE, env=env
    )
    try:
        assert writer.stdout.readline().decode().strip() == "locked"
        live = folder / live_name
        past = time.time() - 60
        os.utime(live, (past, past))  # old enough: only its chief's lock protects it
        model = nn.Linear(2, 2)
        path = Checkpoint(model=model).save(str(folder / "model"), sharded=True)
        assert os.path.isdir(path)
        assert not os.path.exists(os.path.join(path, FOLDER_LOCK))  # let go once in place
        assert [p for p in stale if p.exists()] == []
        assert all(p.exists() for p in kept)
        assert live.exists()  # a live save's folder is kept
        assert link.is_symlink()  # a link is never followed nor removed
    finally:
        writer.kill()
        writer.wait(timeout=30)
        writer.stdout.close()
    Checkpoint(model=nn.Linear(2, 2)).save(str(folder / "model"), sharded=True)
    assert not live.exists()  # its chief was killed: the next save removes it
