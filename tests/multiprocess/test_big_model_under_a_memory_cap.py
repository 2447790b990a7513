"""A model bigger than what any worker may hold, loaded straight into the shards: 4 workers, each
in its own memory cgroup (v1) capped at its runtime plus 0.8 x the model's float32 bytes, build
a ~100 MB model on the meta device under FullyShardedStrategy, load it from a ``torch.save``
file (the plain ``load_state_dict(torch.load(path, mmap=True))``) and from a safetensors file,
train a few steps and save the end weights as safetensors, matching one device. The same
program under MultiWorkerMirroredStrategy (which holds the whole model on every worker, so
builds it on the CPU) is killed by the cap. Skipped where no memory cgroup can be made (not
root, no cgroup v1 memory controller).

The workers run with glibc's default malloc settings, as a user's process does. The full-size
run (docs/big_models.md) is the same test at another size: ``PHALANX_BIG_MODEL_BYTES=1.07e9``
builds 64 x ``Linear(2048, 2048)`` (a 2048-wide stack of that many bytes; under 500 MB, a
1024-wide one), and ``pytest -s`` prints each worker's measured peak."""

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
# the opt-in full size, read here as PHALANX_TORCH_CONFORMANCE is (a test's size, no phalanx knob)
MODEL_BYTES = float(os.environ.get("PHALANX_BIG_MODEL_BYTES", "0") or 0)


def _shape(model_bytes: float) -> tuple[int, int]:
    """(width, depth) of the stack of about ``model_bytes`` float32 bytes (0: the default size)."""
    if not model_bytes:
        return 1024, 24  # 25.2M float32 parameters: 100.7 MB
    width = 2048 if model_bytes >= 5e8 else 1024
    return width, max(1, round(model_bytes / (width * (width + 1) * 4)))


WIDTH, DEPTH = _shape(MODEL_BYTES)
# seconds per worker run: the default size's, scaled with the model (the box may be loaded)
TIMEOUT = 240 * max(1.0, WIDTH * (WIDTH + 1) * DEPTH * 4 / 2e8)
TOL = {"rtol": 1e-5, "atol": 1e-6}
MEMORY = Path("/sys/fs/cgroup/memory")


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
    cap = runtime + int(0.8 * model_bytes)
    (group / "memory.limit_in_bytes").write_text(str(cap))
    losses, peaks = {}, {}
    for kind in ("torch", "safetensors"):
        (group / "memory.max_usage_in_bytes").write_text("0")  # this program's peak from here
        end = os.path.join(folder, f"end-{kind}.safetensors")
        losses[kind] = _program(strategy, WIDTH, DEPTH, sources[kind], end)
        peaks[kind] = int((group / "memory.max_usage_in_bytes").read_text())
        gc.collect()  # the model of one program is gone before the next (FSDP2's modules hold cycles)
    return {"losses": losses, "runtime": runtime, "cap": cap, "peaks": peaks}


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
    workers = runner.run(capped, [str(g) for g in memory_groups], sources, str(out), timeout=TIMEOUT)
    assert [_oom_kills(g) for g in memory_groups] == [0] * WORKERS
    model_mb = WIDTH * (WIDTH + 1) * DEPTH * 4 / 1e6
    for rank, worker in enumerate(workers):  # shown with pytest -s (docs/big_models.md's figures)
        peaks = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in worker["peaks"].items())
        print(
            f"worker {rank}: model {model_mb:.1f} MB, runtime {worker['runtime'] / 2**20:.0f} MiB, "
            f"cap {worker['cap'] / 2**20:.0f} MiB, peak (cgroup) {peaks}"
        )
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
        runner.run(capped, groups, sources, str(out), timeout=TIMEOUT)
    assert not isinstance(failed.value, ClusterTimeout)
    assert re.search(r"'worker-\d': -9", str(failed.value)), "a worker was killed (SIGKILL)"
    assert sum(_oom_kills(g) for g in memory_groups) >= 1, "by the cgroup's OOM killer"
