"""A worker's measured peak resident memory against estimate_memory's, under MultiWorkerMirrored
and FullySharded (2 real processes on 127.0.0.1, glibc's default malloc settings)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.experimental import estimate_memory
from phalanx.memory import PeakMeter
from phalanx.memory.estimate import TRAINING_IMPORTS_BYTES

pytestmark = pytest.mark.multiprocess
WIDTH, LAYERS, GLOBAL_BATCH, STEPS = 1024, 4, 16, 4
# The benchmark holds the estimate to 10 % on quiet runs. Here the machine may be loaded: which
# thread frees a block first, and when gloo's threads let a work go, move a few MiB of
# allocator slack at a ~100-160 MiB peak (glibc's default settings, as a user's process has
# them). 20 % leaves room for that and still fails on what the estimate exists to catch: a
# copy of the 32 MiB Adam state is 20-30 % of these peaks.
TOLERANCE = 0.2


def _mlp(device: str) -> nn.Module:
    with torch.device(device):
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])


def _train_measured(strategy: phalanx.Strategy) -> dict:
    """Every worker: a few Adam steps from a meter started just after the strategy was made
    (and after torch._dynamo, which making the optimizer imports: modules, not the strategy's)."""
    import torch._dynamo  # noqa: F401

    torch.set_num_threads(1)
    meter = PeakMeter()
    torch.manual_seed(0)
    with strategy.scope():
        model = _mlp("cpu")
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    per = GLOBAL_BATCH // strategy.num_replicas_in_sync
    x, y = torch.randn(per, WIDTH), torch.randint(0, WIDTH, (per,))

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / GLOBAL_BATCH
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(STEPS):
        strategy.run(step)
    return {"peak": meter.growth(), "reset_ok": meter.reset_ok}


def _check(results: list[dict], kind: str) -> int:
    if not all(r["reset_ok"] for r in results):
        pytest.skip("this kernel does not let a process reset its VmHWM (/proc/self/clear_refs)")
    estimate = estimate_memory(
        _mlp("meta"),
        torch.optim.Adam,
        strategy=kind,
        num_workers=2,
        sample_input=(WIDTH,),
        per_worker_batch=GLOBAL_BATCH // 2,
        built_whole=True,  # made on the CPU in the scope
    )
    peak = max(r["peak"] for r in results)
    expected = estimate.peak - TRAINING_IMPORTS_BYTES  # torch._dynamo was imported before the meter
    assert abs(expected - peak) <= TOLERANCE * peak, (kind, estimate.breakdown_mib(), peak / 2**20)
    return peak


def test_the_estimate_is_near_the_measured_peak_and_sharding_halves_the_state(mwms_2workers, fsdp_2workers):
    mirrored = _check(mwms_2workers.run(_train_measured, timeout=300), "multi_worker_mirrored")
    sharded = _check(fsdp_2workers.run(_train_measured, timeout=300), "fully_sharded")
    assert sharded < 0.8 * mirrored
