"""The ps's row update for Adagrad (`phalanx.ps.variable_store.sparse_adagrad`) writes what torch's sparse
Adagrad writes, bit for bit, and leaves every case it does not take to torch."""

from __future__ import annotations

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from phalanx.ps.variable_store import sparse_adagrad
from phalanx.ps.variable_store.optimizer import StoreOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def _row_grad(table: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    rows = torch.unique(torch.randint(0, table.shape[0], (n,), generator=generator))
    values = torch.randn(len(rows), *table.shape[1:], dtype=table.dtype, generator=generator)
    return torch.sparse_coo_tensor(rows[None], values, table.shape).coalesce()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "hyper",
    [
        {"lr": 0.1},
        {"lr": 0.5, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-6},
        {"lr": torch.tensor(0.3)},
    ],
)
def test_rows_match_torch_bit_for_bit(dtype: torch.dtype, hyper: dict) -> None:
    g = torch.Generator().manual_seed(0)
    torch_table = torch.randn(500, 8, dtype=dtype, generator=g)
    our_table = torch_table.clone()
    reference = torch.optim.Adagrad([torch_table], **hyper)
    ours = torch.optim.Adagrad([our_table], **hyper)
    for n in (1, 40, 300, 40):
        grad = _row_grad(torch_table, n, g)
        torch_table.grad = grad
        reference.step()
        torch_table.grad = None
        group = ours.param_groups[0]
        assert sparse_adagrad.takes(ours, group, our_table, grad)
        sparse_adagrad.apply_rows(group, ours.state[our_table], our_table, grad)
        assert torch.equal(our_table, torch_table)
        assert torch.equal(ours.state[our_table]["sum"], reference.state[torch_table]["sum"])
        assert torch.equal(ours.state[our_table]["step"], reference.state[torch_table]["step"])


def _takes(optimizer: torch.optim.Optimizer, table: torch.Tensor, grad: torch.Tensor) -> bool:
    return sparse_adagrad.takes(optimizer, optimizer.param_groups[0], table, grad)


def test_what_it_leaves_to_torch() -> None:
    g = torch.Generator().manual_seed(1)
    table = torch.zeros(50, 4)
    grad = _row_grad(table, 10, g)
    assert _takes(torch.optim.Adagrad([table], lr=0.1), table, grad)
    assert not _takes(torch.optim.Adagrad([table], lr=0.1), table, grad.to_dense())
    assert not _takes(torch.optim.Adagrad([table], lr=0.1, maximize=True), table, grad)
    assert not _takes(torch.optim.Adagrad([table], lr=0.1, weight_decay=0.1), table, grad)
    assert not _takes(torch.optim.SGD([table], lr=0.1), table, grad)
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[3, 3]]), torch.ones(2, 4), (50, 4))
    assert not _takes(torch.optim.Adagrad([table], lr=0.1), table, uncoalesced)

    class Mine(torch.optim.Adagrad):
        pass

    assert not _takes(Mine([table], lr=0.1), table, grad)


def test_store_optimizer_steps_rows_and_dense_together_as_torch() -> None:
    """A push of a table's rows and a dense weight: the rows by `apply_rows`, the weight by
    torch's step, the same values as torch stepping both."""
    g = torch.Generator().manual_seed(2)
    variables = {"table": torch.randn(100, 4, generator=g), "w": torch.randn(3, generator=g)}
    reference = {k: v.clone() for k, v in variables.items()}
    store = StoreOptimizer(torch.optim.Adagrad, [{"names": ["table", "w"], "lr": 0.2}], variables)
    torch_opt = torch.optim.Adagrad(list(reference.values()), lr=0.2)
    for _ in range(3):
        grads = [_row_grad(variables["table"], 20, g), torch.randn(3, generator=g)]
        store.step([variables["table"], variables["w"]], grads)
        for tensor, grad in zip(reference.values(), grads, strict=True):
            tensor.grad = grad
        torch_opt.step()
        for name in variables:
            assert torch.equal(variables[name], reference[name]), name
            assert variables[name].grad is None


@pytest.mark.parametrize("with_dense", [False, True])
def test_step_hooks_run_once_around_the_whole_step(with_dense: bool) -> None:
    """As torch's ``step()``: the optimizer's own and the global pre-hooks before any variable
    changed, the post-hooks after all did, once per push."""
    g = torch.Generator().manual_seed(3)
    variables = {"table": torch.randn(30, 2, generator=g), "w": torch.randn(2, generator=g)}
    store = StoreOptimizer(torch.optim.Adagrad, [{"names": ["table", "w"], "lr": 0.2}], variables)
    before = {k: v.clone() for k, v in variables.items()}
    seen: list[tuple[str, bool]] = []

    def changed() -> bool:
        return any(not torch.equal(variables[k], before[k]) for k in variables)

    assert store.torch is not None
    handles = [
        store.torch.register_step_pre_hook(lambda *args: seen.append(("pre", changed()))),
        store.torch.register_step_post_hook(lambda *args: seen.append(("post", changed()))),
        torch_optimizer.register_optimizer_step_pre_hook(
            lambda *args: seen.append(("global pre", changed()))
        ),
        torch_optimizer.register_optimizer_step_post_hook(
            lambda *args: seen.append(("global post", changed()))
        ),
    ]
    try:
        names = ["table", "w"] if with_dense else ["table"]
        grads = [_row_grad(variables["table"], 5, g), torch.ones(2)][: len(names)]
        store.step([variables[n] for n in names], grads)
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [("global pre", False), ("pre", False), ("post", True), ("global post", True)]
    assert torch.equal(variables["w"], before["w"]) != with_dense
