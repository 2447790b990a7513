"""read_since: the chief's copies learn only what changed on the ps tasks (a table's rows that
row gradients wrote, a variable written whole, nothing for one nobody wrote), and a copy kept
up to date that way always equals a full read."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from phalanx.ps import messages, wire
from phalanx.ps.handles import VariableHandle
from phalanx.ps.variable_store.store import VariableStore
from phalanx.ps.variables import PSClient


class _StoreClient:
    """An RpcClient that calls a store's handlers in this process, through the wire format."""

    def __init__(self, store: VariableStore) -> None:
        self.store, self.name = store, store.task_name

    def call(self, method, header, tensors=()):  # noqa: ANN001, ANN201 - RpcClient.call's
        header, tensors = wire.unpack(wire.pack(dict(header), list(tensors)))
        reply = self.store.handlers()[method](header, tensors)
        return wire.unpack(reply.data if isinstance(reply, wire.Packed) else wire.pack(*reply))

    def close(self) -> None:
        pass


def _store(cls, hyper, rows=8):
    store = VariableStore()
    store.create("emb", torch.randn(rows, 3, generator=torch.Generator().manual_seed(0)))
    store.create("bias", torch.zeros(3))
    store.create_optimizer("opt", cls, [{"names": ["emb", "bias"], **hyper}])
    return store


def _row_grad(rows, seed, size=(8, 3)):
    values = torch.randn(len(rows), size[1], generator=torch.Generator().manual_seed(seed))
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, size, check_invariants=True)


def _push(store, names, grads):
    header, tensors = messages.encode_gradients(names, grads)
    header.update(key="opt", hyperparameters=None)
    _StoreClient(store).call("apply_gradients", header, tensors)


def _since(store, names, since, identity=None):
    header = {"names": names, "since": since, "identity": identity or store.identity}
    return _StoreClient(store).call("read_since", header)


@pytest.mark.parametrize(
    ("cls", "hyper", "rows_only"),
    [
        (torch.optim.Adagrad, {"lr": 0.5}, True),
        (torch.optim.SGD, {"lr": 0.5}, True),
        (torch.optim.SparseAdam, {"lr": 0.1}, True),
        # a momentum buffer carries earlier rows; weight decay and Adam densify: whole tables
        (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}, False),
        (torch.optim.Adagrad, {"lr": 0.5, "weight_decay": 0.1}, False),
        (torch.optim.Adam, {"lr": 0.5}, False),
    ],
)
def test_a_copy_patched_with_what_changed_equals_a_full_read(cls, hyper, rows_only):
    store = _store(cls, hyper)
    if cls is torch.optim.SparseAdam:  # SparseAdam takes only row gradients: the bias is assigned
        store.create_optimizer("opt", cls, [{"names": ["emb"], **hyper}], overwrite=True)
    client = PSClient([_StoreClient(store)])
    handles = [
        VariableHandle("emb", 0, (8, 3), "torch.float32"),
        VariableHandle("bias", 0, (3,), "torch.float32"),
    ]
    copies = [torch.zeros(8, 3), torch.zeros(3)]
    known: dict = {}
    kinds_seen = []
    for step, rows in enumerate([[1, 3], [3, 5, 5], [0], [2, 6]]):
        _push(store, ["emb"], [_row_grad(rows, step)])
        if step == 2:
            store.assign(["bias"], [torch.full((3,), 2.0)])
        patches, known = client.read_since(handles, known)
        kinds_seen.append([[type(p.rows).__name__ for p in patches.get(i, [])] for i in range(2)])
        for position, copy in enumerate(copies):
            for patch in patches.get(position, ()):
                patch.apply(copy)
        torch.testing.assert_close(copies, client.read(handles), rtol=0, atol=0)
    # the first read is whole; later ones send the rows of the table alone, or the table whole
    assert kinds_seen[0] == [["NoneType"], ["NoneType"]]
    table = "Tensor" if rows_only else "NoneType"
    assert kinds_seen[1:] == [[[table], []], [[table], ["NoneType"]], [[table], []]]


def test_rows_go_only_for_tables_written_by_rows_since_while_they_are_fewer_bytes():
    store = _store(torch.optim.Adagrad, {"lr": 0.5})
    start = store.version()
    _push(store, ["emb"], [_row_grad([1, 3], 0)])
    header, tensors = _since(store, ["emb", "bias"], [start, start])
    assert header["kinds"] == ["rows", "same"]
    assert header["version"] == store.version()
    assert tensors[0].tolist() == [1, 3]
    assert torch.equal(tensors[1], store.read(["emb"])[0][[1, 3]])
    after_rows = store.version()
    _push(store, ["emb"], [_row_grad([0, 2, 4], 1)])
    # a row is 12 bytes and its number 8: 3 rows of 8 (60 bytes) go as rows, 5 (100) whole (96)
    assert _since(store, ["emb"], [after_rows])[0]["kinds"] == ["rows"]
    assert _since(store, ["emb"], [start])[0]["kinds"] == ["whole"]
    assert _since(store, ["emb"], [store.version()])[0]["kinds"] == ["same"]
    _push(store, ["emb"], [_row_grad([0], 2).to_dense()])  # a dense gradient writes it whole
    assert _since(store, ["emb"], [store.version() - 1])[0]["kinds"] == ["whole"]
    assert _since(store, ["emb"], [-1])[0]["kinds"] == ["whole"]  # never read


def test_another_stores_versions_read_everything_whole():
    store = _store(torch.optim.Adagrad, {"lr": 0.5})
    version = store.version()
    assert _since(store, ["emb", "bias"], [version, version])[0]["kinds"] == ["same", "same"]
    restarted = _since(store, ["emb", "bias"], [version, version], identity="a restarted task's")
    assert restarted[0]["kinds"] == ["whole", "whole"]
    assert restarted[0]["identity"] == store.identity != VariableStore().identity


def test_a_step_hook_makes_a_row_step_write_the_whole_table():
    store = _store(torch.optim.Adagrad, {"lr": 0.5})
    start = store.version()
    hook = register_optimizer_step_post_hook(lambda *args: None)
    try:
        _push(store, ["emb"], [_row_grad([1], 0)])
    finally:
        hook.remove()
    assert _since(store, ["emb"], [start])[0]["kinds"] == ["whole"]


def test_row_versions_of_a_sharded_table_land_at_its_shards_rows():
    stores = [VariableStore("ps:0"), VariableStore("ps:1")]
    table = torch.arange(24.0).reshape(8, 3)
    stores[0].create("t/part_0", table[:5])
    stores[1].create("t/part_1", table[5:])
    for i, store in enumerate(stores):
        store.create_optimizer("opt", torch.optim.SGD, [{"names": [f"t/part_{i}"], "lr": 1.0}])
    shards = (
        VariableHandle("t/part_0", 0, (5, 3), "torch.float32"),
        VariableHandle("t/part_1", 1, (3, 3), "torch.float32"),
    )
    handle = VariableHandle("t/whole", 0, (8, 3), "torch.float32", shards=shards)
    client = PSClient([_StoreClient(s) for s in stores])
    try:
        copy = torch.zeros(8, 3)
        patches, known = client.read_since([handle], {})
        assert [p.rows for p in patches[0]] == [slice(0, 5), slice(5, 8)]
        for patch in patches[0]:
            patch.apply(copy)
        _push(stores[1], ["t/part_1"], [_row_grad([2], 0, size=(3, 3))])  # row 7 of the table
        patches, known = client.read_since([handle], known)
        (patch,) = patches[0]
        assert patch.rows.tolist() == [7]
        patch.apply(copy)
        assert torch.equal(copy, client.read([handle])[0])
    finally:
        client.close()


def test_malformed_read_since_requests_and_replies_are_refused():
    store = _store(torch.optim.Adagrad, {"lr": 0.5})
    with pytest.raises(ValueError, match="one integer version per variable named"):
        _since(store, ["emb", "bias"], [0])
    with pytest.raises(ValueError, match="one integer version per variable named"):
        _since(store, ["emb"], ["3"])
    with pytest.raises(KeyError, match="has no variable 'nope'"):
        _since(store, ["nope"], [0])

    class _Odd(_StoreClient):
        def call(self, method, header, tensors=()):  # noqa: ANN001, ANN201
            return {"version": 1, "identity": "x", "kinds": ["some"]}, []

    client = PSClient([_Odd(store)])
    with pytest.raises(ValueError, match="'same', 'rows' or 'whole'. Received: 'some' from ps task 0"):
        client.read_since([VariableHandle("emb", 0, (8, 3), "torch.float32")], {})


def test_copies_patched_while_pushes_go_on_end_equal_to_a_full_read():
    """Reads in the middle of a long run of pushes (as a checkpoint's state_dict mid-round):
    each is one snapshot, so the copy that follows the last read equals the table."""
    store = _store(torch.optim.Adagrad, {"lr": 0.1}, rows=4096)
    client = PSClient([_StoreClient(store)])
    handle = VariableHandle("emb", 0, (4096, 3), "torch.float32")
    copy, known, kinds = torch.zeros(4096, 3), {}, set()
    stop = threading.Event()
    pushed = [0]

    def pushes() -> None:
        step = 0
        while not stop.is_set():
            rows = torch.randint(0, 4096, (3,), generator=torch.Generator().manual_seed(step)).tolist()
            _push(store, ["emb"], [_row_grad(sorted(set(rows)), step, size=(4096, 3))])
            step += 1
            pushed[0] = step
            time.sleep(0.0005)  # a few pushes between two reads: most reads send rows

    pusher = threading.Thread(target=pushes)
    pusher.start()
    try:
        deadline = time.monotonic() + 30
        while pushed[0] < 300 and time.monotonic() < deadline:
            time.sleep(0.001)
            patches, known = client.read_since([handle], known)
            for patch in patches.get(0, ()):
                kinds.add(type(patch.rows).__name__)
                patch.apply(copy)
    finally:
        stop.set()
        pusher.join(30)
    patches, known = client.read_since([handle], known)
    for patch in patches.get(0, ()):
        patch.apply(copy)
    assert torch.equal(copy, client.read([handle])[0])
    assert "Tensor" in kinds  # rows went while the pushes ran
