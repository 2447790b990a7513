"""phalanx.ps.variable_store.store: a ps task's variables, its optimizers (one push at a time) and its
RPC table.

Messages go through `phalanx.ps.wire` (pack, then unpack) as a client's would.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from phalanx.ps import messages, wire
from phalanx.ps.variable_store.store import VariableStore

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}


def _call(store, method, header, tensors=()):
    """One RPC through the handler table and the wire format, both ways."""
    header, tensors = wire.unpack(wire.pack(header, list(tensors)))
    reply = store.handlers()[method](header, tensors)
    return wire.unpack(reply.data if isinstance(reply, wire.Packed) else wire.pack(*reply))


def _push(store, key, names, grads, hyperparameters=None):
    header, tensors = messages.encode_gradients(names, grads)
    header.update(key=key, hyperparameters=hyperparameters)
    return _call(store, "apply_gradients", header, tensors)


def _read(store, names):
    return _call(store, "read", {"names": list(names)})[1]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _store_of(model, cls, groups_hyper, task="ps:0"):
    """A store holding ``model``'s parameters, with optimizer "opt" (one group per Linear)."""
    store = VariableStore(task)
    names = [n for n, _ in model.named_parameters()]
    _call(store, "create", {"names": names, "overwrite": False}, [p.detach() for p in model.parameters()])
    groups = [{"names": names[:2], **groups_hyper[0]}, {"names": names[2:], **groups_hyper[1]}]
    header = {"key": "opt", "optimizer": messages.encode_optimizer_class(cls), "groups": groups}
    _call(store, "create_optimizer", {**header, "overwrite": False})
    return store, names


def _grads(model, step):
    torch.manual_seed(100 + step)
    model.zero_grad()
    model(torch.randn(8, 3)).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------------- variables
def test_create_stores_a_detached_cpu_copy_and_is_idempotent():
    store = VariableStore()
    source = torch.ones(2, 2, requires_grad=True)
    store.create("w", source)
    source.data.fill_(5.0)
    (value,) = store.read(["w"])
    assert torch.equal(value, torch.ones(2, 2))
    assert not value.requires_grad
    value.fill_(9.0)  # a read is a copy
    version = store.version()
    store.create("w", torch.zeros(2, 2))  # a restarted coordinator creates its variables again
    assert torch.equal(store.read(["w"])[0], torch.ones(2, 2))
    assert store.version() == version
    store.create("w", torch.full((2, 2), 7.0), overwrite=True)
    assert torch.equal(store.read(["w"])[0], torch.full((2, 2), 7.0))
    assert store.version() == version + 1
    store.create("b", torch.zeros(1))
    assert store.names() == ["w", "b"]


@pytest.mark.parametrize("value", [torch.ones(3), torch.ones(2, dtype=torch.float64)])
@pytest.mark.parametrize("overwrite", [False, True])
def test_create_with_another_dtype_or_shape_raises(value, overwrite):
    store = VariableStore("ps:1")
    store.create("w", torch.ones(2))
    with pytest.raises(ValueError, match=r"variable 'w' on ps:1 is torch.float32 \(2,\); received"):
        store.create("w", value, overwrite=overwrite)


def test_reading_an_unknown_variable_names_it_and_the_task():
    store = VariableStore("ps:3")
    with pytest.raises(KeyError, match="ps:3 has no variable 'x'.*HINT: .*strategy.scope"):
        store.read(["x"])


def test_assign_and_assign_add_write_and_count_versions():
    store = VariableStore()
    store.create("a", torch.zeros(2))
    store.create("b", torch.zeros(3))
    v = store.version()
    assert _call(store, "assign", {"names": ["a", "b"]}, [torch.ones(2), torch.full((3,), 2.0)])[0] == {
        "version": v + 1
    }
    assert _call(store, "assign_add", {"names": ["a"]}, [torch.ones(2)])[0] == {"version": v + 2}
    assert [t.tolist() for t in _read(store, ["a", "b"])] == [[2.0, 2.0], [2.0, 2.0, 2.0]]
    assert _call(store, "version", {})[0] == {"version": v + 2}
    assert _call(store, "names", {})[0] == {"names": ["a", "b"]}


@pytest.mark.parametrize("method", ["assign", "assign_add"])
@pytest.mark.parametrize(
    ("names", "values", "error", "match"),
    [
        (["a", "b"], [torch.ones(2), torch.ones(2)], ValueError, r"'b' on ps:0 is torch.float32 \(3,\)"),
        (["a", "b"], [torch.ones(2), torch.ones(3, dtype=torch.int64)], ValueError, "received torch.int64"),
        (["a", "b"], [torch.ones(2)], ValueError, "exactly one value. Received: names"),
        (["a", "a"], [torch.ones(2), torch.ones(2)], ValueError, "name each variable once"),
        (["a", "zz"], [torch.ones(2), torch.ones(2)], KeyError, "no variable 'zz'"),
    ],
)
def test_a_bad_write_raises_and_writes_nothing(method, names, values, error, match):
    store = VariableStore()
    store.create("a", torch.zeros(2))
    store.create("b", torch.zeros(3))
    v = store.version()
    with pytest.raises(error, match=match):
        getattr(store, method)(names, values)
    assert store.version() == v
    assert torch.equal(store.read(["a"])[0], torch.zeros(2))  # all or nothing


def test_read_rows_and_read_if_newer():
    store = VariableStore()
    store.create("emb", torch.arange(10.0).reshape(5, 2))
    _, (rows,) = _call(store, "read_rows", {"name": "emb"}, [torch.tensor([4, 0, 4])])
    assert rows.tolist() == [[8.0, 9.0], [0.0, 1.0], [8.0, 9.0]]
    v = store.version()
    assert _call(store, "read_if_newer", {"names": ["emb"], "version": v}) == (
        {"version": v, "changed": False},
        [],
    )
    header, (value,) = _call(store, "read_if_newer", {"names": ["emb"], "version": v - 1})
    assert header == {"version": v, "changed": True}
    assert torch.equal(value, store.read(["emb"])[0])


def test_read_if_newer_reads_rows_in_the_same_call_changed_or_not():
    store = VariableStore()
    store.create("emb", torch.arange(10.0).reshape(5, 2))
    store.create("w", torch.ones(3))
    store.create("other", torch.arange(4.0).reshape(2, 2))
    v = store.version()
    header = {"names": ["w"], "version": v, "rows": ["emb", "other"]}
    reply, tensors = _call(store, "read_if_newer", header, [torch.tensor([4, 0]), torch.tensor([1])])
    assert reply == {"version": v, "changed": False}
    assert [t.tolist() for t in tensors] == [[[8.0, 9.0], [0.0, 1.0]], [[2.0, 3.0]]]
    header["version"] = v - 1
    reply, tensors = _call(store, "read_if_newer", header, [torch.tensor([4, 0]), torch.tensor([1])])
    assert reply == {"version": v, "changed": True}
    assert [t.tolist() for t in tensors] == [[1.0, 1.0, 1.0], [[8.0, 9.0], [0.0, 1.0]], [[2.0, 3.0]]]


def test_read_if_newer_refuses_rows_without_one_tensor_per_table():
    store = VariableStore()
    store.create("emb", torch.zeros(5, 2))
    with pytest.raises(ValueError, match="one tensor of rows per table .* Received: 1 tables"):
        store.handlers()["read_if_newer"]({"names": [], "version": 0, "rows": ["emb"]}, [])
    with pytest.raises(IndexError, match="asked for row 7"):
        store.handlers()["read_if_newer"]({"names": [], "version": 0, "rows": ["emb"]}, [torch.tensor([7])])


@pytest.mark.parametrize(
    ("rows", "error", "match"),
    [
        (
            torch.tensor([1, 5]),
            IndexError,
            r"in \[0, 5\): variable 'emb' on ps:0 has 5 rows; asked for row 5",
        ),
        (torch.tensor([-1]), IndexError, "has 5 rows; asked for row -1"),
        (torch.tensor([[1]]), ValueError, "1-D integer tensor"),
        (torch.tensor([1.0]), ValueError, "rows torch.float32"),
    ],
)
def test_read_rows_refuses_bad_rows(rows, error, match):
    store = VariableStore()
    store.create("emb", torch.zeros(5, 2))
    with pytest.raises(error, match=match):
        store.read_rows("emb", rows)


def test_read_rows_of_a_scalar_or_unknown_variable_raises():
    store = VariableStore()
    store.create("s", torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"'s' \(\) on ps:0"):
        store.read_rows("s", torch.tensor([0]))
    with pytest.raises(KeyError, match="no variable 'emb'"):
        store.read_rows("emb", torch.tensor([0]))


def test_create_handler_wants_one_tensor_per_name():
    with pytest.raises(ValueError, match="one tensor per name. Received: 2 names and 1 tensors"):
        _call(VariableStore(), "create", {"names": ["a", "b"]}, [torch.ones(1)])


# ---------------------------------------------------------------------- optimizers: parity
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_pushes_equal_a_local_optimizer(name):
    """Two groups with different lr; at step 2 the last bias gets no gradient."""
    cls, hyper = OPTIMIZERS[name]
    groups_hyper = [hyper, {**hyper, "lr": hyper["lr"] / 4}]
    model = _model()
    store, names = _store_of(model, cls, groups_hyper)
    params = list(model.parameters())
    local = cls([{"params": params[:2], **groups_hyper[0]}, {"params": params[2:], **groups_hyper[1]}])
    for step in range(5):
        grads = _grads(model, step)
        pushed = names if step != 2 else names[:-1]
        if step == 2:
            params[-1].grad = None
            before = _read(store, names[-1:])[0]
        local.step()
        _push(store, "opt", pushed, grads[: len(pushed)])
        if step == 2:
            assert torch.equal(_read(store, names[-1:])[0], before)  # no gradient: no change at all
    for ours, theirs in zip(_read(store, names), params, strict=True):
        assert torch.equal(ours, theirs.detach())


def test_hyperparameters_with_a_push_act_like_a_local_lr_scheduler():
    cls, hyper = OPTIMIZERS["sgd"]
    model = _model()
    store, names = _store_of(model, cls, [hyper, hyper])
    params = list(model.parameters())
    local = cls([{"params": params[:2], **hyper}, {"params": params[2:], **hyper}])
    scheduler = torch.optim.lr_scheduler.StepLR(local, step_size=2, gamma=0.1)  # lr changes before step 3
    for step in range(4):
        grads = _grads(model, step)
        lrs = [{"lr": g["lr"]} for g in local.param_groups]
        local.step()
        scheduler.step()
        _push(store, "opt", names, grads, lrs if step == 2 else None)  # the new lr persists
    assert store.optimizer_state("opt")["groups"][0]["lr"] == pytest.approx(0.01)
    for ours, theirs in zip(_read(store, names), params, strict=True):
        assert torch.equal(ours, theirs.detach())


def test_adam_betas_arrive_as_a_json_list_and_work():
    model = _model()
    store, names = _store_of(model, torch.optim.Adam, [{"lr": 0.01, "betas": [0.8, 0.99]}] * 2)
    local = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.99))
    for step in range(2):
        grads = _grads(model, step)
        local.step()
        betas = [{"betas": [0.8, 0.99]}] * 2
        _push(store, "opt", names, grads, betas)
    assert isinstance(store._optimizers["opt"].torch.param_groups[0]["betas"], tuple)
    for ours, theirs in zip(_read(store, names), model.parameters(), strict=True):
        assert torch.equal(ours, theirs.detach())


def _emb_store(cls, hyper):
    store = VariableStore()
    torch.manual_seed(0)
    table = torch.randn(6, 3)
    store.create("emb", table)
    header = {"key": "opt", "optimizer": messages.encode_optimizer_class(cls)}
    _call(store, "create_optimizer", {**header, "groups": [{"names": ["emb"], **hyper}]})
    local = table.clone().requires_grad_()
    return store, local, cls([local], **hyper)


@pytest.mark.parametrize(
    ("cls", "hyper", "local_sparse"),
    [
        (torch.optim.SGD, {"lr": 0.5}, True),
        (torch.optim.Adagrad, {"lr": 0.5}, True),
        (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}, True),
        # torch refuses these sparse: the ps applies the dense gradient they stand for
        (torch.optim.SGD, {"lr": 0.5, "weight_decay": 0.1}, False),
        (torch.optim.Adagrad, {"lr": 0.5, "weight_decay": 0.1}, False),
        (torch.optim.Adam, {"lr": 0.5}, False),
    ],
)
def test_sparse_gradients_through_the_handlers_equal_local(cls, hyper, local_sparse):
    store, local, local_opt = _emb_store(cls, hyper)
    for step, rows in enumerate([[1, 3], [3, 5, 5], [0]]):
        torch.manual_seed(step)
        grad = torch.sparse_coo_tensor(
            torch.tensor([rows]), torch.randn(len(rows), 3), (6, 3), check_invariants=True
        )
        header, tensors = messages.encode_gradients(["emb"], [grad])
        assert header["sparse"] == [0]
        assert header["sparse_sizes"] == {"0": [6, 3]}
        assert len(tensors) == 2
        local.grad = grad if local_sparse else grad.to_dense()
        local_opt.step()
        _push(store, "opt", ["emb"], [grad])
    torch.testing.assert_close(_read(store, ["emb"])[0], local.detach(), rtol=1e-6, atol=1e-6)
    if not hyper.get("weight_decay"):
        assert torch.equal(_read(store, ["emb"])[0][[2, 4]], local.detach()[[2, 4]])  # never pushed


def test_a_dense_and_a_sparse_gradient_in_one_message():
    grads = [
        torch.ones(2),
        torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 2), (3, 2), check_invariants=True),
    ]
    header, tensors = messages.encode_gradients(["d", "s"], grads)
    header, tensors = wire.unpack(wire.pack(header, tensors))
    dense, sparse = messages.decode_gradients(header, tensors)
    assert torch.equal(dense, grads[0])
    assert torch.equal(sparse.to_dense(), grads[1].to_dense())


@pytest.mark.parametrize(
    ("rows", "coalesced"), [([0, 2, 5], True), ([4], True), ([], True), ([2, 0, 5], False), ([1, 1], False)]
)
def test_a_sorted_sparse_gradient_arrives_coalesced_and_any_other_as_sent(rows, coalesced):
    """A worker sends coalesced gradients (sorted, unique rows): the ps takes them as such,
    and the optimizer's coalesce() sorts nothing; other indices are coalesced there as before."""
    values = torch.arange(len(rows) * 2, dtype=torch.float32).reshape(len(rows), 2)
    indices = torch.tensor([rows], dtype=torch.int64).reshape(1, len(rows))
    header = {"names": ["s"], "sparse": [0], "sparse_sizes": {"0": [6, 2]}}
    (grad,) = messages.decode_gradients(header, [indices, values])
    assert grad.is_coalesced() == coalesced
    expected = torch.zeros(6, 2).index_add_(0, indices[0], values)
    assert torch.equal(grad.to_dense(), expected)
    assert torch.equal(grad.coalesce().to_dense(), expected)


@pytest.mark.parametrize(
    ("header", "tensors"),
    [
        ({"names": ["s"], "sparse": [0], "sparse_sizes": {}}, [torch.zeros(1, 1), torch.ones(1, 2)]),
        ({"names": ["s"], "sparse": [1], "sparse_sizes": {"1": [3]}}, [torch.ones(3)]),
        ({"names": ["s"], "sparse": [], "sparse_sizes": {}}, [torch.ones(3), torch.ones(3)]),
    ],
)
def test_a_malformed_gradient_message_raises(header, tensors):
    with pytest.raises(ValueError, match="one tensor per dense and two per sparse gradient"):
        messages.decode_gradients(header, tensors)


def test_sparse_indices_outside_the_variable_are_refused_before_any_update():
    store, _, _ = _emb_store(torch.optim.SGD, {"lr": 1.0})
    header = {"key": "opt", "names": ["emb"], "sparse": [0], "sparse_sizes": {"0": [6, 3]}}
    with pytest.raises(RuntimeError, match="size is inconsistent with indices"):
        _call(store, "apply_gradients", header, [torch.tensor([[7]]), torch.ones(1, 3)])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_state_restored_into_a_fresh_store_continues_like_uninterrupted(name):
    cls, hyper = OPTIMIZERS[name]
    groups_hyper = [hyper, {**hyper, "lr": hyper["lr"] / 2}]
    model = _model()
    first, names = _store_of(model, cls, groups_hyper)
    for step in range(3):
        _push(first, "opt", names, _grads(model, step))
    header, tensors = _call(first, "optimizer_state", {"key": "opt"})
    second, _ = _store_of(_model(), cls, [{"lr": 1.0}, {"lr": 1.0}], task="ps:1")
    _call(second, "assign", {"names": names}, _read(first, names))
    v = second.version()
    assert _call(second, "load_optimizer_state", {**header, "key": "opt"}, tensors)[0] == {"version": v + 1}
    assert second.optimizer_state("opt")["groups"][1]["lr"] == hyper["lr"] / 2
    for step in range(3, 6):
        grads = _grads(model, step)
        for s in (first, second):
            _push(s, "opt", names, grads)
    for ours, theirs in zip(_read(second, names), _read(first, names), strict=True):
        assert torch.equal(ours, theirs)


def test_optimizer_state_encoding_keeps_numbers_and_tensors_apart():
    state = {"state": {"w": {"step": 3, "buf": torch.ones(2)}}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
    header, tensors = messages.encode_optimizer_state(state)
    assert header["state"] == {"w": {"step": 3}}
    assert header["tensor_entries"] == [["w", "buf"]]
    decoded = messages.decode_optimizer_state(*wire.unpack(wire.pack(header, tensors)))
    assert decoded["state"]["w"]["step"] == 3
    assert torch.equal(decoded["state"]["w"]["buf"], torch.ones(2))
    assert decoded["groups"] == [{"lr": 0.1, "betas": [0.9, 0.99]}]
    with pytest.raises(ValueError, match="one tensor per tensor entry. Received: 1 entries and 0 tensors"):
        messages.decode_optimizer_state(header, [])


def _sgd_store():
    store = VariableStore()
    store.create("w", torch.ones(2))
    store.create("v", torch.ones(2))
    store.create_optimizer("o", torch.optim.SGD, [{"names": ["w"], "lr": 1.0, "momentum": 0.9}])
    return store


def test_loading_state_drops_what_it_does_not_hold_and_refuses_strangers():
    store = _sgd_store()
    store.apply_gradients("o", ["w"], [torch.ones(2)])
    assert "momentum_buffer" in store.optimizer_state("o")["state"]["w"]
    store.load_optimizer_state("o", {"state": {}, "groups": []})
    assert store.optimizer_state("o")["state"] == {}
    with pytest.raises(ValueError, match="state of \\['v'\\]; variable 'v' is not updated by optimizer 'o'"):
        store.load_optimizer_state("o", {"state": {"v": {}}, "groups": []})
    with pytest.raises(ValueError, match="Received: 2 for the 1 param groups"):
        store.load_optimizer_state("o", {"state": {}, "groups": [{}, {}]})
    with pytest.raises(KeyError, match="no optimizer 'p'"):
        store.optimizer_state("p")


# ---------------------------------------------------------------------- optimizers: rules
def test_a_group_without_variables_here_keeps_the_group_indices():
    store = VariableStore()
    store.create("w", torch.ones(2))
    store.create_optimizer("o", torch.optim.SGD, [{"names": [], "lr": 1.0}, {"names": ["w"], "lr": 0.5}])
    store.apply_gradients("o", ["w"], [torch.ones(2)], [{"lr": 1.0, "momentum": 0.0}, {"lr": 0.25}])
    assert torch.equal(store.read(["w"])[0], torch.full((2,), 0.75))
    assert store.optimizer_state("o")["groups"] == [{"lr": 1.0, "momentum": 0.0}, {"lr": 0.25}]
    with pytest.raises(ValueError, match=r"cannot set \['names'\].*group 0"):
        store.apply_gradients("o", [], [], [{"names": ["w"]}, {}])
    only_placeholders = VariableStore()
    only_placeholders.create_optimizer("o", torch.optim.SGD, [{"names": [], "lr": 1.0}])
    only_placeholders.apply_gradients("o", [], [], [{"lr": 2.0}])
    assert only_placeholders.optimizer_state("o") == {"state": {}, "groups": [{"lr": 2.0}]}


def test_bad_hyperparameters_raise_and_change_nothing():
    store = VariableStore()
    store.create("a", torch.ones(2))
    store.create("b", torch.ones(2))
    store.create_optimizer("o", torch.optim.SGD, [{"names": ["a"], "lr": 1.0}, {"names": ["b"], "lr": 1.0}])
    with pytest.raises(ValueError, match=r"cannot set \['params'\].*group 1 of optimizer 'o' on ps:0"):
        store.apply_gradients("o", ["a"], [torch.ones(2)], [{"lr": 5.0}, {"params": 1}])
    with pytest.raises(ValueError, match="Received: 1 for the 2 param groups"):
        store.apply_gradients("o", ["a"], [torch.ones(2)], [{"lr": 5.0}])
    assert store.optimizer_state("o")["groups"] == [{"lr": 1.0}, {"lr": 1.0}]
    assert torch.equal(store.read(["a"])[0], torch.ones(2))


@pytest.mark.parametrize(
    ("names", "grads", "error", "match"),
    [
        (["v"], [torch.ones(2)], ValueError, "variable 'v' is not updated by optimizer 'o' on ps:0"),
        (["w"], [torch.ones(3)], ValueError, r"gradient must have its variable's dtype and shape.*\(3,\)"),
        (["w"], [torch.ones(2, dtype=torch.float64)], ValueError, "received torch.float64"),
        (["w"], [], ValueError, "exactly one gradient"),
        (["w", "w"], [torch.ones(2), torch.ones(2)], ValueError, "name each variable once"),
    ],
)
def test_a_bad_push_raises_and_changes_nothing(names, grads, error, match):
    store = _sgd_store()
    v = store.version()
    with pytest.raises(error, match=match):
        store.apply_gradients("o", names, grads)
    assert store.version() == v
    assert torch.equal(store.read(["w"])[0], torch.ones(2))


def test_pushing_to_an_unknown_optimizer_hints_at_the_scope():
    with pytest.raises(KeyError, match="ps:0 has no optimizer 'x'.*HINT: .*strategy.scope"):
        _sgd_store().apply_gradients("x", ["w"], [torch.ones(2)])


def test_create_optimizer_again_is_idempotent_and_updates_hyperparameters():
    class Custom(torch.optim.SGD):  # by value through cloudpickle: a new class object each time
        pass

    store = VariableStore()
    store.create("w", torch.ones(2))
    header = {"key": "o", "optimizer": messages.encode_optimizer_class(Custom), "overwrite": False}
    _call(store, "create_optimizer", {**header, "groups": [{"names": ["w"], "lr": 1.0, "momentum": 0.9}]})
    store.apply_gradients("o", ["w"], [torch.ones(2)])
    _call(store, "create_optimizer", {**header, "groups": [{"names": ["w"], "lr": 0.5, "momentum": 0.9}]})
    state = store.optimizer_state("o")
    assert state["groups"] == [{"lr": 0.5, "momentum": 0.9}]
    assert "momentum_buffer" in state["state"]["w"]
    store.create_optimizer("o", torch.optim.Adam, [{"names": ["w"], "lr": 0.1}], overwrite=True)
    assert store.optimizer_state("o") == {"state": {}, "groups": [{"lr": 0.1}]}


@pytest.mark.parametrize(
    ("cls", "groups", "error", "match"),
    [
        (torch.optim.Adam, [{"names": ["w"], "lr": 1.0}], ValueError, "is a SGD over"),
        (torch.optim.SGD, [{"names": ["w", "v"], "lr": 1.0}], ValueError, "it has other variables"),
        (torch.optim.SGD, [{"names": ["w"]}, {"names": ["w"]}], ValueError, r"repeating \['w'\]"),
        (torch.optim.SGD, [{"names": ["v", "v"]}], ValueError, r"repeating \['v'\]"),
        (torch.optim.SGD, [{"params": ["w"], "names": ["w"]}], ValueError, "has no 'params'"),
        (torch.optim.SGD, [{"lr": 1.0}], ValueError, "names its variables under 'names'"),
        (torch.optim.SGD, [{"names": ["nope"]}], KeyError, "no variable 'nope'"),
    ],
)
def test_create_optimizer_refuses(cls, groups, error, match):
    store = _sgd_store()
    with pytest.raises(error, match=match):
        store.create_optimizer("o", cls, groups)


def test_concurrent_pushes_are_atomic():
    store = VariableStore()
    store.create("w", torch.zeros(4))
    store.create_optimizer("o", torch.optim.SGD, [{"names": ["w"], "lr": 1.0}])
    start = threading.Barrier(4)

    def push():
        start.wait()
        for _ in range(100):
            store.apply_gradients("o", ["w"], [torch.ones(4)])

    threads = [threading.Thread(target=push) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(store.read(["w"])[0], torch.full((4,), -400.0))
    assert store.version() == 1 + 400


def test_a_push_can_return_the_values_of_that_step():
    store = _sgd_store()
    header, tensors = messages.encode_gradients(["w"], [torch.ones(2)])
    reply = _call(store, "apply_gradients", {**header, "key": "o", "return_values": True}, tensors)
    assert reply[0] == {"version": store.version()}
    assert torch.equal(reply[1][0], torch.zeros(2))


def test_a_hyperparameter_added_later_is_taken():
    """An LR scheduler attached after the optimizer was created on the ps adds initial_lr."""
    store = _sgd_store()
    store.apply_gradients("o", ["w"], [torch.ones(2)], [{"lr": 0.5, "initial_lr": 1.0}])
    assert store.optimizer_state("o")["groups"][0]["initial_lr"] == 1.0


def test_a_read_is_packed_under_the_lock_from_one_snapshot():
    store = VariableStore()
    store.create("w", torch.ones(3))
    reply = store.handlers()["read_if_newer"]({"names": ["w"], "version": -1}, [])
    assert isinstance(reply, wire.Packed)  # one copy: the variable's bytes, straight into the reply
    store.assign(["w"], [torch.full((3,), 7.0)])
    header, (value,) = wire.unpack(reply.data)
    assert header == {"version": 1, "changed": True}
    assert value.tolist() == [1.0, 1.0, 1.0]  # the value read, not the variable's memory
