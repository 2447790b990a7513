"""Sparse gradients (``nn.Embedding(sparse=True)``) under MultiWorkerMirroredStrategy.

Two worker processes, with one local replica (gradient buckets: the embedding's sparse
gradient is summed apart from the buckets, by gathering indices and values) and with two
(mirrored variables: summed sparsely after the packed dense sums). Both transports. The
gradient read after backward and the weights after two steps equal one device's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.multiprocess

GLOBAL = 8
STEPS = 2


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 12, (STEPS, GLOBAL, 3), generator=g)  # (steps, batch, tokens)
    return ids, torch.randn(STEPS, GLOBAL, 1, generator=g)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(12, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


def _loss(model: nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(ids) - y) ** 2).sum() / GLOBAL


def one_device() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    ids, ys = _data()
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, ids[step], ys[step]).backward()
        seen.append(model.embed.weight.grad.to_dense())
        opt.step()
    return seen, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(strategy) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """On every worker: the embedding gradients each replica read after backward, the weights."""
    ids, ys = _data()
    with strategy.scope():
        model = Model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    per = GLOBAL // strategy.num_replicas_in_sync

    def part(t: torch.Tensor, step: int):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: t[step, ctx.replica_id_in_sync_group * per : (ctx.replica_id_in_sync_group + 1) * per]
        )

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        _loss(model, x, y).backward()
        seen = model.embed.weight.grad.to_dense()
        opt.step()
        return seen

    seen = []
    for step in range(STEPS):
        out = strategy.run(step_fn, args=(part(ids, step), part(ys, step)))
        seen.append(list(strategy.experimental_local_results(out)))
    return seen, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]], ids=["1replica", "2replicas"])
@pytest.mark.parametrize("transport", ["shared_memory", "gloo"])
def test_sparse_embedding_trains_as_on_one_device(mwms_2workers, devices, transport):
    env = {"PHALANX_SHARED_MEMORY": "1" if transport == "shared_memory" else "0"}
    results = mwms_2workers.run(train, strategy_kwargs={"devices": devices}, env=env)
    want_seen, want_state = one_device()
    for seen, state in results:
        for step, replicas in enumerate(seen):
            assert len(replicas) == len(devices)
            for got in replicas:
                torch.testing.assert_close(got, want_seen[step], rtol=1e-5, atol=1e-6)
        for name, value in state.items():
            torch.testing.assert_close(value, want_state[name], rtol=1e-5, atol=1e-6)
