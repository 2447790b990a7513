"""Distributed variables: what modules created in a scope hold, how they are read, written and saved."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import phalanx
from phalanx.variables import VariableAggregation, set_aggregation


class WithBuffers(nn.Module):
    """A custom module with buffers of every kind."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))
        self.register_buffer("float_buf", torch.full((2,), 3.0))
        self.register_buffer("int_buf", torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", set_aggregation(torch.zeros(()), "sum"))
        self.register_buffer("on_write", set_aggregation(torch.zeros(2), "mean", "on_write"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale * self.float_buf


def _run_each(strategy, fn):
    return strategy.experimental_local_results(strategy.run(fn))


def _rid():
    return phalanx.get_replica_context().replica_id_in_sync_group


def test_modules_created_in_scope_hold_distributed_variables(mirrored_2cpu):
    with mirrored_2cpu.scope():
        linear, conv, bn = nn.Linear(3, 2), nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)
        emb, lstm, dropout, custom = nn.Embedding(5, 3), nn.LSTM(3, 4), nn.Dropout(0.5), WithBuffers()
    for module in (linear, conv, bn, emb, lstm, custom):
        for p in module.parameters():
            assert isinstance(p, phalanx.MirroredVariable)
            assert isinstance(p, nn.Parameter)  # modules, optimizers and isinstance checks accept it
    assert list(dropout.parameters()) == []
    for name, aggregation in [
        ("running_mean", "MEAN"),
        ("running_var", "MEAN"),
        ("num_batches_tracked", "ONLY_FIRST_REPLICA"),
    ]:
        buffer = getattr(bn, name)
        assert isinstance(buffer, phalanx.SyncOnReadVariable)
        assert not isinstance(buffer, nn.Parameter)
        assert buffer.aggregation is VariableAggregation[aggregation]
    assert custom.float_buf.aggregation is VariableAggregation.MEAN
    assert custom.int_buf.aggregation is VariableAggregation.ONLY_FIRST_REPLICA
    assert custom.total.aggregation is VariableAggregation.SUM
    assert isinstance(custom.on_write, phalanx.MirroredVariable)

    def fn():
        y = bn(conv(torch.randn(2, 1, 5, 5)))
        out, _ = lstm(emb(torch.tensor([[1, 2]])))
        return (
            y.shape,
            out.shape,
            dropout(torch.ones(4)).shape,
            custom(torch.ones(2)),
            linear(torch.ones(3)).shape,
        )

    for result in _run_each(mirrored_2cpu, fn):
        assert result[:3] == (torch.Size([2, 2, 3, 3]), torch.Size([1, 2, 4]), torch.Size([4]))


def test_components_are_copies_of_the_initialised_primary(mirrored_2cpu):
    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(4, 3), nn.LSTM(3, 2)).state_dict()
    torch.manual_seed(0)
    with mirrored_2cpu.scope():
        model = nn.Sequential(nn.Linear(4, 3), nn.LSTM(3, 2))
    mirrored_2cpu.run(lambda: None)
    for name, p in model.named_parameters():
        components = p.components
        assert len(components) == 2
        assert components[0].data_ptr() != components[1].data_ptr()  # one copy per replica
        for component in components:
            torch.testing.assert_close(component, expected[name], rtol=0, atol=0, msg=name)


class ManyLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.conv = nn.Conv1d(8, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(tokens))
        h, _ = self.gru(h)
        h, _ = self.att(h, h, h)
        return self.head(self.conv(h.transpose(1, 2)).mean(-1)) * self.scale


def _train_many_layers(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = ManyLayers()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randint(0, 10, (7, 5), generator=g), torch.randint(0, 3, (7,), generator=g)) for _ in range(3)
    ]

    def step(x, y):
        loss = phalanx.compute_average_loss(nn.functional.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = [
        strategy.reduce("sum", strategy.run(step, args=b), axis=None).item()
        for b in strategy.experimental_distribute_dataset(data)
    ]
    return losses, model.state_dict()


def test_embedding_lstm_gru_attention_conv_train_like_one_device():
    ref_losses, ref_state = _train_many_layers(phalanx.OneDeviceStrategy("cpu"))
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(4)])  # 7 examples: 2/2/2/1
    try:
        losses, state = _train_many_layers(strategy)
    finally:
        strategy._threads.close()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _write_copy(layer):
    with torch.no_grad():
        layer.weight.copy_(torch.full((1, 2), 2.0))


def _write_load_state_dict(layer):
    layer.load_state_dict({"weight": torch.full((1, 2), 2.0), "bias": layer.bias.detach().clone()})


def _write_init(layer):
    nn.init.constant_(layer.weight, 2.0)


def _write_fill(layer):
    with torch.no_grad():
        layer.weight.fill_(1.0)
        layer.weight.mul_(2.0)


def _write_data_copy(layer):
    layer.weight.data.copy_(torch.full((1, 2), 2.0))


def _write_data_assign(layer):
    layer.weight.data = torch.full((1, 2), 2.0)


def _write_vector_to_parameters(layer):
    vector = torch.cat([torch.full((2,), 2.0), layer.bias.detach().reshape(-1)])
    nn.utils.vector_to_parameters(vector, layer.parameters())


_ALWAYS_MIRRORED = [_write_copy, _write_load_state_dict, _write_fill]
_WRITE_CASES = [
    *(pytest.param("mirrored_2cpu", w, id=f"mirrored-{w.__name__}") for w in _ALWAYS_MIRRORED),
    *(
        pytest.param("mirrored_2cpu", w, id=f"mirrored-{w.__name__}")
        for w in (_write_init, _write_data_copy, _write_data_assign, _write_vector_to_parameters)
    ),
    # CentralStorage's same-device replicas alias the one central copy
    *(
        pytest.param("central_storage_2cpu", w, id=f"central-{w.__name__}")
        for w in (
            *_ALWAYS_MIRRORED,
            _write_init,
            _write_data_copy,
            _write_data_assign,
            _write_vector_to_parameters,
        )
    ),
]


@pytest.mark.parametrize(("name", "write"), _WRITE_CASES)
def test_cross_replica_writes_reach_every_replica_at_the_next_run(name, write, request):
    strategy = request.getfixturevalue(name)
    with strategy.scope():
        layer = nn.Linear(2, 1)
    strategy.run(lambda: None)  # components exist before the write
    write(layer)
    bias = layer.bias.item()
    for value in _run_each(strategy, lambda: layer(torch.ones(1, 2))):
        assert value.item() == pytest.approx(4.0 + bias)


@pytest.mark.parametrize("name", ["mirrored_2cpu", "central_storage_2cpu"])
def test_zero_grad_outside_run_clears_every_replica(name, request):
    strategy = request.getfixturevalue(name)
    torch.manual_seed(0)
    with strategy.scope():
        layer = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    reference = nn.Linear(2, 1)
    reference.load_state_dict(layer.state_dict())
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    xs = [torch.randn(4, 2) for _ in range(3)]

    def step(x):
        phalanx.compute_average_loss(layer(x).squeeze(-1)).backward()
        optimizer.step()

    for x, batch in zip(xs, strategy.experimental_distribute_dataset(xs), strict=True):
        optimizer.zero_grad()  # in cross-replica context, as many loops do
        strategy.run(step, args=(batch,))
        ref_optimizer.zero_grad()
        reference(x).squeeze(-1).mean().backward()
        ref_optimizer.step()
    torch.testing.assert_close(layer.weight.detach(), reference.weight.detach())


def test_freezing_with_the_requires_grad_setter_after_a_run_freezes_every_replica(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)

    def step():
        layer(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    mirrored_2cpu.run(step)
    layer.weight.requires_grad = False
    frozen = layer.weight.detach().clone()
    mirrored_2cpu.run(step)
    assert [c.requires_grad for c in layer.weight.components] == [False, False]
    torch.testing.assert_close(layer.weight.detach(), frozen)


def test_requires_grad_method_after_a_run_freezes_every_replica(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 1)
    mirrored_2cpu.run(lambda: None)
    layer.weight.requires_grad_(False)
    assert [c.requires_grad for c in layer.weight.components] == [False, False]
    assert not layer.weight.requires_grad


@pytest.mark.parametrize("name", ["mirrored_2cpu", "central_storage_2cpu"])
def test_state_dicts_outside_run_are_plain_and_load_into_plain_torch(name, request):
    strategy = request.getfixturevalue(name)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    data = [torch.randn(6, 2) for _ in range(2)]

    def step(x):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(batch,))
    state = model.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    components = model[1].running_mean.components
    torch.testing.assert_close(state["1.running_mean"], (components[0] + components[1]) / 2)  # MEAN on read
    plain = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    plain.load_state_dict(state)
    opt_state = optimizer.state_dict()
    for entry in opt_state["state"].values():
        assert all(type(v) is torch.Tensor for v in entry.values())
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.1)
    plain_optimizer.load_state_dict(opt_state)
    assert plain_optimizer.state_dict()["state"][0]["step"].item() == 2.0


@pytest.mark.parametrize("name", ["mirrored_2cpu", "central_storage_2cpu"])
def test_loading_a_state_dict_updates_every_replica(name, request):
    strategy = request.getfixturevalue(name)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    strategy.run(lambda: None)
    source = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        source[1].running_mean.fill_(0.5)
        source[1].num_batches_tracked.fill_(7)
    with strategy.scope():
        model.load_state_dict(source.state_dict())
    for component in model[1].running_mean.components:
        torch.testing.assert_close(component, torch.full((2,), 0.5))
    assert [c.item() for c in model[1].num_batches_tracked.components] == [7, 7]
    model.eval()
    source.eval()
    x = torch.randn(3, 2)
    for value in _run_each(strategy, lambda: model(x)):
        torch.testing.assert_close(value, source(x))


def test_sync_on_read_variables_aggregate_on_read(mirrored_2cpu):
    with mirrored_2cpu.scope():
        custom = WithBuffers()

    seen = {}

    def fn():
        r = _rid()
        with torch.no_grad():
            custom.float_buf.add_(r)  # each replica writes its own component
            custom.int_buf.add_(r + 5)
            custom.total.add_(r + 1)
        seen[r] = (custom.float_buf.clone(), custom.total.clone())

    mirrored_2cpu.run(fn)
    torch.testing.assert_close(seen[1][0], torch.full((2,), 4.0))  # inside run: the replica's own value
    assert (seen[0][1].item(), seen[1][1].item()) == (1.0, 2.0)
    torch.testing.assert_close(custom.float_buf * 1, torch.full((2,), 3.5))  # MEAN of 3 and 4
    assert custom.int_buf.item() == 5  # ONLY_FIRST_REPLICA
    assert custom.total.item() == 3.0  # SUM


def test_sync_on_read_cross_replica_writes(mirrored_2cpu):
    with mirrored_2cpu.scope():
        custom = WithBuffers()
    mirrored_2cpu.run(lambda: None)
    custom.total.fill_(10.0)  # SUM: the total becomes 10, held by the first replica
    assert custom.total.item() == 10.0
    assert [c.item() for c in custom.total.components] == [10.0, 0.0]
    custom.total.add_(1.0)
    assert [c.item() for c in custom.total.components] == [11.0, 0.0]
    custom.float_buf.copy_(torch.tensor([1.0, 2.0]))  # MEAN: every replica takes the value
    for component in custom.float_buf.components:
        torch.testing.assert_close(component, torch.tensor([1.0, 2.0]))
    custom.float_buf.zero_()
    assert custom.float_buf.sum().item() == 0.0


def test_replica_context_writes_of_mirrored_variables(mirrored_2cpu):
    with mirrored_2cpu.scope():
        plain = nn.Linear(1, 1)
        holder = nn.Module()
        holder.mean = set_aggregation(nn.Parameter(torch.zeros(1)), "mean")
        holder.sum = set_aggregation(nn.Parameter(torch.zeros(1)), VariableAggregation.SUM)
        holder.first = set_aggregation(nn.Parameter(torch.zeros(1)), "only_first_replica")
    for write in (lambda: plain.bias.add_(1.0), lambda: plain.bias.copy_(torch.ones(1)), plain.bias.zero_):

        def in_no_grad(write=write):
            with torch.no_grad():
                write()

        with pytest.raises(RuntimeError, match=r"needs an aggregation.*HINT: annotate it"):
            mirrored_2cpu.run(in_no_grad)

    def writes():
        r = float(_rid())
        with torch.no_grad():
            holder.mean.copy_(torch.tensor([r * 2]))  # mean of 0 and 2
            holder.sum.add_(torch.tensor([r + 1]))  # 0 + (1 + 2)
            holder.first.copy_(torch.tensor([r + 5]))  # replica 0's value

    mirrored_2cpu.run(writes)
    assert [c.item() for c in holder.mean.components] == [1.0, 1.0]
    assert [c.item() for c in holder.sum.components] == [3.0, 3.0]
    assert [c.item() for c in holder.first.components] == [5.0, 5.0]

    def unsupported():
        with torch.no_grad():
            holder.mean.mul_(2)

    with pytest.raises(NotImplementedError, match=r"supports only \['copy_', 'add_', 'sub_'\].*mul_"):
        mirrored_2cpu.run(unsupported)


def test_torch_save_and_deepcopy_give_plain_tensors(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    mirrored_2cpu.run(lambda: None)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    for clone in (loaded, copied):
        assert all(type(p) is nn.Parameter for p in clone.parameters())
        assert all(type(b) is torch.Tensor for b in clone.buffers())
        for key, value in model.state_dict().items():
            torch.testing.assert_close(clone.state_dict()[key], value)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    assert all(type(v) is torch.Tensor for v in torch.load(buffer, weights_only=True).values())


def test_one_device_places_plain_parameters_and_buffers(one_device):
    with one_device.scope():
        bn = nn.BatchNorm1d(2)
    assert type(bn.weight) is nn.Parameter
    assert type(bn.running_mean) is torch.Tensor
    assert bn.running_mean.device.type == "cpu"


def test_moving_a_model_to_its_device_keeps_its_variables(mirrored_2cpu):
    with mirrored_2cpu.scope():
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).to("cpu")
    model.cpu().float()
    assert isinstance(model[0].weight, phalanx.MirroredVariable)
    assert isinstance(model[1].running_mean, phalanx.SyncOnReadVariable)


def test_converting_the_dtype_after_a_run_reaches_every_replica(mirrored_2cpu):
    with mirrored_2cpu.scope():
        layer = nn.Linear(2, 2)
    mirrored_2cpu.run(lambda: None)
    layer.double()
    for value in _run_each(mirrored_2cpu, lambda: layer(torch.ones(1, 2, dtype=torch.float64))):
        assert value.dtype == torch.float64


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4).t())  # a non-contiguous parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_non_contiguous_parameter_trains_like_one_device(mirrored_2cpu):
    def train(strategy):
        torch.manual_seed(0)
        with strategy.scope():
            model = Transposed()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            phalanx.compute_average_loss(model(x).sum(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset([torch.ones(4, 4)]):
            strategy.run(step, args=(batch,))
        return model.weight.detach()

    torch.testing.assert_close(train(mirrored_2cpu), train(phalanx.OneDeviceStrategy("cpu")))


def test_sparse_embedding_gradients_are_summed(mirrored_2cpu):
    def train(strategy):
        torch.manual_seed(0)
        with strategy.scope():
            emb = nn.Embedding(5, 2, sparse=True)
            optimizer = torch.optim.SGD(emb.parameters(), lr=0.1)

        def step(tokens):
            phalanx.compute_average_loss(emb(tokens).sum(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset([torch.tensor([1, 2, 2, 4])]):
            strategy.run(step, args=(batch,))
        return emb.weight.detach()

    torch.testing.assert_close(train(mirrored_2cpu), train(phalanx.OneDeviceStrategy("cpu")))


def test_sparse_gradients_with_packed_reductions_are_summed():
    ops = phalanx.ReductionToOneDevice(accumulation_fn=lambda ts: torch.stack(ts).sum(0))  # packed path
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
    try:
        with strategy.scope():
            emb = nn.Embedding(5, 2, sparse=True)
            optimizer = torch.optim.SGD(emb.parameters(), lr=0.1)

        def step():
            emb(torch.tensor([1, 2])).sum().backward()
            grad = emb.weight.grad.to_dense()
            optimizer.step()
            return grad

        want = torch.zeros(5, 2)
        want[[1, 2]] = 2.0  # both replicas looked up rows 1 and 2
        for grad in strategy.run(step).values:
            torch.testing.assert_close(grad, want)
        torch.testing.assert_close(emb.weight.components[0], emb.weight.components[1])
    finally:
        strategy._threads.close()


def test_central_storage_replica_writes_are_merged(central_storage_2cpu):
    with central_storage_2cpu.scope():
        holder = nn.Module()
        holder.total = set_aggregation(nn.Parameter(torch.zeros(1)), "sum")

    def write():
        with torch.no_grad():
            holder.total.add_(torch.tensor([_rid() + 1.0]))

    central_storage_2cpu.run(write)
    assert holder.total.item() == 3.0
    assert [v.item() for v in _run_each(central_storage_2cpu, lambda: holder.total * 1)] == [3.0, 3.0]
