"""FullyShardedStrategy with real processes on 127.0.0.1 (gloo): the same custom loop as under
MultiWorkerMirroredStrategy gives its weights, with each worker holding only its shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import phalanx

pytestmark = pytest.mark.multiprocess
GLOBAL_BATCH, STEPS = 8, 3
TOL = {"rtol": 1e-5, "atol": 1e-6}


class Net(nn.Module):
    """An MLP whose sizes do not divide by 2 (uneven shards), optionally with activation
    checkpointing and a weight tied between its input and output layers."""

    def __init__(self, recompute: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(7, 33, bias=False)
        self.hidden = nn.Sequential(nn.Linear(33, 33), nn.Tanh(), nn.Linear(33, 33))
        self.norm = nn.LayerNorm(33)
        self.head = nn.Linear(33, 7, bias=False)
        if tied:
            self.head.weight = nn.Parameter(self.embed.weight.detach().t().contiguous())
            self.embed.weight = self.head.weight  # (7, 33) used as (33 -> 7) and transposed
        self.recompute, self.tied = recompute, tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.head.weight if self.tied else self.embed(x)
        h = checkpoint(self.hidden, h, use_reentrant=False) if self.recompute else self.hidden(h)
        return self.head(self.norm(torch.relu(h)))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randint(0, 7, (GLOBAL_BATCH,), generator=gen))
        for _ in range(STEPS)
    ]


def _train(
    strategy: phalanx.Strategy,
    recompute: bool = False,
    tied: bool = False,
    clip: float = 0.0,
    adam: bool = False,
    meta: bool = False,
) -> dict:
    """The custom loop (runs in each worker): SGD with momentum (it sees a sum's scale, which
    Adam would normalise away) or Adam, TF's loss convention, optional clipping."""
    torch.manual_seed(10 + strategy.worker_rank)  # different on every worker: the chief's must win
    with strategy.scope(), torch.device("meta" if meta else "cpu"):  # meta: FullySharded's values
        model = Net(recompute, tied)
        if adam:
            optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        if clip:
            norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            assert float(norm) > clip, "the test must clip"
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = []
    for x, y in strategy.experimental_distribute_dataset(_data()):
        loss = strategy.run(step, args=(x, y))
        losses.append(strategy.reduce("sum", loss, axis=None).item())
    local = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in model.named_parameters()}
    moments = [s["exp_avg" if adam else "momentum_buffer"] for s in optimizer.state.values()]
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "local_numel": sum(local.values()),
        "full_numel": sum(p.numel() for p in model.parameters()),
        "moment_numel": sum((m.to_local() if hasattr(m, "to_local") else m).numel() for m in moments),
    }


def _compare(sharded: list[dict], mirrored: list[dict]) -> None:
    for worker in range(2):
        np.testing.assert_allclose(sharded[worker]["losses"], mirrored[0]["losses"], **TOL)
        assert sharded[worker]["state"].keys() == mirrored[0]["state"].keys()
        for key, value in mirrored[0]["state"].items():
            got = sharded[worker]["state"][key]
            assert type(got) is torch.Tensor, f"{key}: state_dict() outside run gives full tensors"
            np.testing.assert_allclose(got.numpy(), value.numpy(), **TOL, err_msg=key)


@pytest.mark.parametrize("shard", ["full", "optimizer_and_gradients"])
def test_the_same_loop_gives_multi_worker_mirroreds_weights_from_half_the_state(
    mwms_2workers, fsdp_2workers, shard
):
    mirrored = mwms_2workers.run(_train)
    sharded = fsdp_2workers.run(_train, strategy_kwargs={"shard": shard})
    _compare(sharded, mirrored)
    full = sharded[0]["full_numel"]
    assert sharded[0]["local_numel"] + sharded[1]["local_numel"] == full  # each holds its part
    assert max(s["local_numel"] for s in sharded) <= full // 2 + 2 * 33  # uneven rows: at most one more each
    assert sharded[0]["moment_numel"] == sharded[0]["local_numel"]  # the momentum of its shard only


def test_a_model_built_on_the_meta_device_trains_to_the_weights_of_one_built_on_the_cpu(
    mwms_2workers, fsdp_2workers
):
    # no worker ever holds the whole model: the chief initialises one layer at a time
    # (reset_parameters, from the random state it had in the scope) and scatters the shards
    mirrored = mwms_2workers.run(_train)
    sharded = fsdp_2workers.run(_train, False, False, 0.0, False, True)
    _compare(sharded, mirrored)


def test_clipping_and_activation_checkpointing_behave_as_under_multi_worker_mirrored(
    mwms_2workers, fsdp_2workers
):
    mirrored = mwms_2workers.run(_train, True, False, 0.05)
    sharded = fsdp_2workers.run(_train, True, False, 0.05)
    _compare(sharded, mirrored)


def test_tied_weights_are_one_parameter_sharded_once_with_adam(mwms_2workers, fsdp_2workers):
    mirrored = mwms_2workers.run(_train, False, True, 0.0, True)
    sharded = fsdp_2workers.run(_train, False, True, 0.0, True)
    _compare(sharded, mirrored)
    assert "embed.weight" in sharded[0]["state"]
    assert "head.weight" in sharded[0]["state"]


def _scaled(strategy: phalanx.Strategy) -> dict:
    """A plain torch.amp.GradScaler: a normal step, then one whose gradient overflows only in
    rows that FullySharded keeps on worker 1 (weight rows 6-7 of an 8-row layer)."""
    torch.manual_seed(10 + strategy.worker_rank)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(GLOBAL_BATCH, 5, generator=gen) for _ in range(2)]
    boost = torch.ones(8)  # the hidden layer's gradient, scaled per unit (a finite loss)

    def step(x: torch.Tensor) -> None:
        hidden = model[0](x)
        hidden.register_hook(lambda grad: grad * boost)
        loss = model[2](torch.tanh(hidden)).square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    states, scales = [], []
    for i, x in enumerate(strategy.experimental_distribute_dataset(data)):
        boost[6:] = 1.0 if i == 0 else 1e36  # x 2^16: inf in rows 6-7 of model[0] only
        strategy.run(step, args=(x,))
        states.append({k: v.detach().clone().numpy() for k, v in model.state_dict().items()})
        scales.append(scaler.get_scale())
    return {"states": states, "scales": scales}


def test_a_plain_grad_scaler_skips_a_step_that_overflows_in_one_workers_shard(mwms_2workers, fsdp_2workers):
    mirrored = mwms_2workers.run(_scaled)
    sharded = fsdp_2workers.run(_scaled)
    for worker in (*sharded, *mirrored):
        assert worker["scales"] == [2.0**16, 2.0**15]  # the second step overflowed: scale halved
        for key, value in worker["states"][1].items():
            np.testing.assert_array_equal(value, worker["states"][0][key])  # and was skipped
        for key, value in mirrored[0]["states"][0].items():
            np.testing.assert_allclose(worker["states"][0][key], value, **TOL)  # the first was not


def _big_mlp(strategy: phalanx.Strategy, folder: str) -> dict:
    """The 16.8M-parameter MLP of benchmarks/bench_fsdp.py with Adam, two steps
    of the same custom loop; the chief writes the full weights (a file: 67 MB)."""
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()) for _ in range(4)])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 2048, generator=gen), torch.randint(0, 2048, (16,), generator=gen)) for _ in range(2)
    ]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        phalanx.compute_average_loss(per_example, global_batch_size=16).backward()
        optimizer.step()
        optimizer.zero_grad()

    for x, y in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(x, y))
    state = model.state_dict()  # full tensors (a collective under FullyShardedStrategy)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    if strategy.is_chief:
        torch.save(state, f"{folder}/{type(strategy).__name__}.pt")
    return {"full": sum(p.numel() for p in model.parameters()), "local": local}


def test_the_16_8m_parameter_mlp_with_adam_ends_at_multi_worker_mirroreds_weights(
    mwms_2workers, fsdp_2workers, tmp_path
):
    mirrored = mwms_2workers.run(_big_mlp, str(tmp_path))
    sharded = fsdp_2workers.run(_big_mlp, str(tmp_path))
    assert mirrored[0]["full"] == 16_785_408
    assert max(w["local"] for w in sharded) == 16_785_408 // 2  # each worker holds half
    expected = torch.load(tmp_path / "MultiWorkerMirroredStrategy.pt")
    got = torch.load(tmp_path / "FullyShardedStrategy.pt")
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)
