"""The ps task's variable store: variables, optimizers applied one push at a time, its RPC table."""

from __future__ import annotations

import threading

import pytest
import torch

from phalanx.ps import store as store_lib
from phalanx.ps import wire
from phalanx.ps.store import VariableStore

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99)}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}


def _call(store, method, header, tensors=()):
    """Through the RPC table and the wire format, as a client would."""
    header, tensors = wire.unpack(wire.pack(header, list(tensors)))
    reply = store.handlers()[method](header, tensors)
    return wire.unpack(wire.pack(*reply))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_pushes_equal_a_local_optimizer_with_two_groups_and_a_variable_left_out(name):
    cls, hyper = OPTIMIZERS[name]
    torch.manual_seed(0)
    a, b, c = torch.randn(3, 2), torch.randn(4), torch.randn(2)
    local = [t.clone().requires_grad_() for t in (a, b, c)]
    local_opt = cls(
        [{"params": local[:2], **hyper}, {"params": local[2:], **{**hyper, "lr": 0.5 * hyper["lr"]}}]
    )
    store = VariableStore()
    _call(store, "create", {"names": ["a", "b", "c"]}, [a, b, c])
    groups = [{"names": ["a", "b"], **hyper}, {"names": ["c"], **hyper, "lr": 0.5 * hyper["lr"]}]
    header = {"key": "opt", "optimizer": store_lib.encode_optimizer_class(cls), "groups": groups}
    _call(store, "create_optimizer", header)
    for step in range(4):
        grads = [torch.randn_like(t) for t in (a, b, c)]
        names = ["a", "b", "c"] if step != 2 else ["a", "c"]  # b gets no gradient at step 2
        for t, g in zip(local, grads, strict=True):
            t.grad = g.clone()
        if step == 2:
            local[1].grad = None
        local_opt.step()
        sent = [grads[["a", "b", "c"].index(n)] for n in names]
        header, tensors = store_lib.encode_gradients(names, sent)
        _call(store, "apply_gradients", {**header, "key": "opt", "hyperparameters": None}, tensors)
    _, values = _call(store, "read", {"names": ["a", "b", "c"]})
    for ours, theirs in zip(values, local, strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-6)


def test_hyperparameters_sent_with_a_push_act_like_a_scheduler():
    store = VariableStore()
    store.create("w", torch.ones(2))
    store.create_optimizer("o", torch.optim.SGD, [{"names": ["w"], "lr": 1.0}])
    store.apply_gradients("o", ["w"], [torch.ones(2)], [{"lr": 0.5}])
    assert torch.equal(store.read(["w"])[0], torch.full((2,), 0.5))
    with pytest.raises(ValueError, match="no hyperparameters"):
        store.apply_gradients("o", ["w"], [torch.ones(2)], [{"warp": 1}])
    with pytest.raises(ValueError, match="1 param groups"):
        store.apply_gradients("o", ["w"], [torch.ones(2)], [{}, {}])


def test_sparse_gradients_through_the_rpc_table():
    store = VariableStore()
    store.create("emb", torch.ones(5, 2))
    store.create_optimizer("o", torch.optim.SGD, [{"names": ["emb"], "lr": 1.0}])
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 2), (5, 2))
    header, tensors = store_lib.encode_gradients(["emb"], [grad])
    _call(store, "apply_gradients", {**header, "key": "o", "hyperparameters": None}, tensors)
    expected = torch.ones(5, 2)
    expected[[1, 3]] = 0.0
    assert torch.equal(store.read(["emb"])[0], expected)


def test_optimizer_state_round_trips_into_a_fresh_store():
    def fresh():
        s = VariableStore()
        s.create("w", torch.arange(3.0))
        s.create_optimizer("o", torch.optim.Adam, [{"names": ["w"], "lr": 0.1}])
        return s

    first, second, uninterrupted = fresh(), fresh(), fresh()
    for s in (first, uninterrupted):
        s.apply_gradients("o", ["w"], [torch.ones(3)])
    header, tensors = _call(first, "optimizer_state", {"key": "o"})
    _call(second, "assign", {"names": ["w"]}, first.read(["w"]))
    _call(second, "load_optimizer_state", {**header, "key": "o"}, tensors)
    for s in (second, uninterrupted):
        s.apply_gradients("o", ["w"], [torch.ones(3)])
    assert torch.equal(second.read(["w"])[0], uninterrupted.read(["w"])[0])


def test_concurrent_pushes_are_atomic():
    store = VariableStore()
    store.create("w", torch.zeros(4))
    store.create_optimizer("o", torch.optim.SGD, [{"names": ["w"], "lr": 1.0}])

    def push():
        for _ in range(100):
            store.apply_gradients("o", ["w"], [torch.ones(4)])

    threads = [threading.Thread(target=push) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(store.read(["w"])[0], torch.full((4,), -400.0))


def test_variables_reads_writes_and_versions():
    store = VariableStore("ps:1")
    store.create("w", torch.ones(2, 2))
    store.create("w", torch.zeros(2, 2))  # idempotent: a restarted coordinator creates again
    assert torch.equal(store.read(["w"])[0], torch.ones(2, 2))
    v = store.version()
    _call(store, "assign_add", {"names": ["w"]}, [torch.ones(2, 2)])
    assert store.version() == v + 1
    header, tensors = _call(store, "read_if_newer", {"names": ["w"], "version": v + 1})
    assert (header["changed"], tensors) == (False, [])
    header, tensors = _call(store, "read_if_newer", {"names": ["w"], "version": v})
    assert header["changed"]
    assert torch.equal(tensors[0], torch.full((2, 2), 2.0))
    _, (rows,) = _call(store, "read_rows", {"name": "w"}, [torch.tensor([1])])
    assert rows.shape == (1, 2)
    assert _call(store, "names", {})[0] == {"names": ["w"]}
    store.create("w", torch.full((2, 2), 7.0), overwrite=True)
    assert torch.equal(store.read(["w"])[0], torch.full((2, 2), 7.0))


def test_store_errors_name_the_variable_and_the_task():
    store = VariableStore("ps:1")
    store.create("w", torch.ones(2))
    with pytest.raises(KeyError, match="ps:1 has no variable 'x'"):
        store.read(["x"])
    with pytest.raises(ValueError, match=r"'w' on ps:1 is torch.float32 \(2,\)"):
        store.create("w", torch.ones(3))
    with pytest.raises(ValueError, match="received torch.int64"):
        store.assign(["w"], [torch.ones(2, dtype=torch.int64)])
    with pytest.raises(IndexError, match="has 2 rows; asked for row 5"):
        store.read_rows("w", torch.tensor([5]))
    with pytest.raises(KeyError, match="no optimizer 'o'.*strategy.scope"):
        store.apply_gradients("o", ["w"], [torch.ones(2)])
    store.create("v", torch.ones(2))
    store.create_optimizer("o", torch.optim.SGD, [{"names": ["w"], "lr": 1.0}])
    with pytest.raises(ValueError, match="'v' is not updated by optimizer 'o'"):
        store.apply_gradients("o", ["v"], [torch.ones(2)])
    with pytest.raises(ValueError, match="has other variables"):
        store.create_optimizer("o", torch.optim.SGD, [{"names": ["v"], "lr": 1.0}])
    with pytest.raises(ValueError, match="is a SGD"):
        store.create_optimizer("o", torch.optim.Adam, [{"names": ["w"], "lr": 1.0}])


def test_a_group_without_variables_on_this_task_is_a_placeholder():
    store = VariableStore()
    store.create("w", torch.ones(2))
    store.create_optimizer("o", torch.optim.SGD, [{"names": [], "lr": 1.0}, {"names": ["w"], "lr": 0.5}])
    store.apply_gradients("o", ["w"], [torch.ones(2)], [{"lr": 1.0}, {"lr": 0.5}])
    assert torch.equal(store.read(["w"])[0], torch.full((2,), 0.5))
    assert store.optimizer_state("o")["groups"][0]["lr"] == 1.0


def test_a_sparse_gradient_with_an_index_out_of_range_is_refused():
    store = VariableStore()
    store.create("emb", torch.ones(5, 2))
    store.create_optimizer("o", torch.optim.SGD, [{"names": ["emb"], "lr": 1.0}])
    bad = torch.sparse_coo_tensor(torch.tensor([[9]]), torch.ones(1, 2), (5, 2), check_invariants=False)
    header, tensors = store_lib.encode_gradients(["emb"], [bad])
    with pytest.raises(RuntimeError, match="index"):
        _call(store, "apply_gradients", {**header, "key": "o", "hyperparameters": None}, tensors)
    assert torch.equal(store.read(["emb"])[0], torch.ones(5, 2))
