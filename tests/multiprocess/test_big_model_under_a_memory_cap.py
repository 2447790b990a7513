"""A model bigger than what any worker may hold, loaded straight into the shards: 4 workers, each
in its own memory cgroup (v1) capped at its runtime plus 0.8 x the model's float32 bytes, build
a ~100 MB model on the meta device under FullyShardedStrategy, load it from a ``torch.save``
file (the plain ``load_state_dict(torch.load(path, mmap=True))``) and from a safetensors file,
train a few steps and save the end weights as safetensors, matching one device. The same
program under MultiWorkerMirroredStrategy (which holds the whole model on every worker, so
builds it on the CPU) is killed by the cap. Skipped where no memory cgroup can be made (not
root, no cgroup v1 memory controller)."""

from __future__ import annotations

import gc
import os
import re
import secrets
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import phalanx
from phalanx.checkpoint.weights import load_safetensors, save_safetensors
from support.cluster import ClusterTimeout
from support.strategies import ProcessRunner

pytestmark = pytest.mark.multiprocess
WORKERS, GLOBAL_BATCH, STEPS = 4, 8, 3
WIDTH, DEPTH = 1024, 24  # 25.2M float32 parameters: 100.7 MB
TOL = {"rtol": 1e-5, "atol": 1e-6}
MEMORY = Path("/sys/fs/cgroup/memory")
# glibc's defaults let the layers FSDP2 gathers each step fragment the heap, which a process's
# usage then counts (docs/big_models.md); this test measures what loading holds, so its workers
# give freed blocks back as benchmarks/bench_fsdp.py's do
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _stack(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


def _data(width: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(GLOBAL_BATCH, width, generator=gen) for _ in range(STEPS)]


def _program(strategy: phalanx.Strategy, width: int, depth: int, source: str, out: str) -> list[float]:
    """The user's program: build, load, train, save the weights as safetensors."""
    sharded = isinstance(strategy, phalanx.experimental.FullyShardedStrategy)
    with strategy.scope(), torch.device("meta" if sharded else "cpu"):  # MWMS refuses meta
        model = _stack(width, depth)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if source.endswith(".safetensors"):
        load_safetensors(model, source)
    else:
        model.load_state_dict(torch.load(source, mmap=True, weights_only=True))

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = phalanx.compute_average_loss(model(x).square().mean(dim=1), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = []
    for x in strategy.experimental_distribute_dataset(_data(width)):
        losses.append(strategy.reduce("sum", strategy.run(step, args=(x,)), axis=None).item())
    save_safetensors(model, out)
    return losses


def capped(strategy: phalanx.Strategy, groups: list[str], sources: dict[str, str], folder: str) -> dict:
    """In each worker: join its cgroup, run the program on a one-layer model (the runtime: the
    collectives' first use, FSDP2's, the shared-memory transport's segments, which one layer's
    gradients fill to their largest), cap the group at that plus 0.8 x the big model's bytes,
    then run the program from each source."""
    group = Path(groups[strategy.worker_rank])
    (group / "cgroup.procs").write_text(str(os.getpid()))
    _program(strategy, WIDTH, 1, sources["layer"], os.path.join(folder, "layer.safetensors"))
    runtime = int((group / "memory.max_usage_in_bytes").read_text())
    model_bytes = WIDTH * (WIDTH + 1) * DEPTH * 4
    (group / "memory.limit_in_bytes").write_text(str(runtime + int(0.8 * model_bytes)))
    losses = {}
    for kind in ("torch", "safetensors"):
        end = os.path.join(folder, f"end-{kind}.safetensors")
        losses[kind] = _program(strategy, WIDTH, DEPTH, sources[kind], end)
        gc.collect()  # the model of one program is gone before the next (FSDP2's modules hold cycles)
    return {"losses": losses}


def _own_memory_group() -> Path | None:
    """This process's memory cgroup (v1), where a child group can be made."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return MEMORY / path.lstrip("/")
    return None


@pytest.fixture
def memory_groups():
    """One fresh memory cgroup per worker under this process's own (removed afterwards)."""
    parent = _own_memory_group()
    if parent is None or not (parent / "memory.limit_in_bytes").is_file():
        pytest.skip("no cgroup v1 memory controller here")
    groups = []
    token = secrets.token_hex(4)
    try:
        for worker in range(WORKERS):
            group = parent / f"phalanx-test-{token}-{worker}"
            group.mkdir()
            groups.append(group)
    except OSError as exc:
        for group in groups:
            group.rmdir()
        pytest.skip(f"cannot make a memory cgroup under {parent} ({exc})")
    yield groups
    for group in groups:
        deadline = time.monotonic() + 10
        while True:  # a killed worker's group empties a moment after its exit
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _oom_kills(group: Path) -> int:
    found = re.search(r"^oom_kill (\d+)$", (group / "memory.oom_control").read_text(), re.MULTILINE)
    return int(found.group(1)) if found else 0


def _one_device(source: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _stack(WIDTH, DEPTH)
    model.load_state_dict(torch.load(source, weights_only=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for x in _data(WIDTH):
        loss = model(x).square().mean(dim=1).sum() / GLOBAL_BATCH
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.fixture
def sources(tmp_path):
    torch.manual_seed(0)
    state = _stack(WIDTH, DEPTH).state_dict()
    paths = {"torch": str(tmp_path / "init.pt"), "safetensors": str(tmp_path / "init.safetensors")}
    torch.save(state, paths["torch"])
    save_file(state, paths["safetensors"])
    paths["layer"] = str(tmp_path / "layer.pt")
    torch.save(_stack(WIDTH, 1).state_dict(), paths["layer"])
    return paths


def test_four_capped_workers_load_train_and_save_a_model_none_of_them_could_hold(
    memory_groups, sources, tmp_path
):
    out = tmp_path / "out"
    out.mkdir()
    runner = ProcessRunner("fsdp_4workers", "experimental.FullyShardedStrategy", tmp_path, WORKERS)
    workers = runner.run(capped, [str(g) for g in memory_groups], sources, str(out), env=MALLOC, timeout=240)
    assert [_oom_kills(g) for g in memory_groups] == [0] * WORKERS
    expected_losses, expected = _one_device(sources["torch"])
    for kind in ("torch", "safetensors"):
        for worker in workers:
            np.testing.assert_allclose(worker["losses"][kind], expected_losses, **TOL)
        got = load_file(out / f"end-{kind}.safetensors")  # written by the 4 workers, each its rows
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            np.testing.assert_allclose(got[key].numpy(), value.numpy(), **TOL, err_msg=key)


def test_the_same_program_under_multi_worker_mirrored_is_killed_by_the_cap(memory_groups, sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    runner = ProcessRunner("mwms_4workers", "MultiWorkerMirroredStrategy", tmp_path, WORKERS)
    groups = [str(g) for g in memory_groups]
    with pytest.raises(AssertionError, match="tasks failed") as failed:
        runner.run(capped, groups, sources, str(out), env=MALLOC, timeout=240)
    assert not isinstance(failed.value, ClusterTimeout)
    assert re.search(r"'worker-\d': -9", str(failed.value)), "a worker was killed (SIGKILL)"
    assert sum(_oom_kills(g) for g in memory_groups) >= 1, "by the cgroup's OOM killer"
