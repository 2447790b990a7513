"""Checkpoint / CheckpointManager: atomic files, any-strategy restore, clear errors."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import phalanx
from phalanx.checkpoint import Checkpoint, CheckpointManager, Counter, latest_checkpoint
from phalanx.checkpoint._files import atomic_save


def _model_and_optimizer(strategy, batch_norm=True):
    torch.manual_seed(0)
    with strategy.scope():
        middle = nn.BatchNorm1d(8) if batch_norm else nn.ReLU()
        model = nn.Sequential(nn.Linear(4, 8), middle, nn.Linear(8, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer


def _train(strategy, model, optimizer, steps=3):
    data = [
        (
            torch.randn(8, 4, generator=torch.Generator().manual_seed(i)),
            torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(100 + i)),
        )
        for i in range(steps)
    ]

    def step(x, y):
        loss = phalanx.compute_average_loss(nn.functional.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=batch)


def test_save_restore_round_trip(tmp_path, one_device):
    model, optimizer = _model_and_optimizer(one_device)
    _train(one_device, model, optimizer)
    counter = Counter(7)
    ckpt = Checkpoint(model=model, optimizer=optimizer, step=counter)
    path = ckpt.save(str(tmp_path / "ckpt"))
    assert path.endswith("ckpt-1.pt")
    assert os.path.exists(path)

    model2, optimizer2 = _model_and_optimizer(phalanx.get_strategy())
    counter2 = Counter()
    Checkpoint(model=model2, optimizer=optimizer2, step=counter2).read(path)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=k)
    assert counter2.value == 7
    assert optimizer2.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("mirrored_2cpu", "one_device"),
        ("one_device", "mirrored_2cpu"),
        ("mirrored_2cpu", "central_storage_2cpu"),
    ],
)
def test_checkpoint_restores_under_another_strategy(tmp_path, request, source, target):
    s1, s2 = request.getfixturevalue(source), request.getfixturevalue(target)
    model, optimizer = _model_and_optimizer(s1)
    _train(s1, model, optimizer)
    path = Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "c.pt"))

    model2, optimizer2 = _model_and_optimizer(s2)
    Checkpoint(model=model2, optimizer=optimizer2).read(path)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=k)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("mirrored_2cpu", "one_device"),
        ("one_device", "mirrored_2cpu"),
        ("mirrored_2cpu", "central_storage_2cpu"),
    ],
)
def test_training_continues_identically_after_cross_strategy_restore(tmp_path, request, source, target):
    # (no BatchNorm: unsynchronised batch statistics legitimately differ between strategies)
    s1, s2 = request.getfixturevalue(source), request.getfixturevalue(target)
    model, optimizer = _model_and_optimizer(s1, batch_norm=False)
    _train(s1, model, optimizer)
    path = Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "c.pt"))
    model2, optimizer2 = _model_and_optimizer(s2, batch_norm=False)
    Checkpoint(model=model2, optimizer=optimizer2).read(path)
    _train(s1, model, optimizer, steps=2)
    _train(s2, model2, optimizer2, steps=2)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)


def test_manager_keeps_newest_and_finds_latest(tmp_path):
    model = nn.Linear(2, 2)
    manager = CheckpointManager(Checkpoint(model=model), str(tmp_path), max_to_keep=2)
    paths = [manager.save() for _ in range(3)]
    assert manager.checkpoints == paths[1:]
    assert not os.path.exists(paths[0])
    assert latest_checkpoint(str(tmp_path)) == paths[-1]
    again = CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), str(tmp_path), max_to_keep=2)
    assert again.restore_or_initialize() == paths[-1]
    assert Checkpoint(model=nn.Linear(2, 2)).restore(str(tmp_path)) is not None


def test_restore_none_and_empty_dir(tmp_path):
    ckpt = Checkpoint(model=nn.Linear(2, 2))
    assert ckpt.restore(None) is ckpt
    with pytest.raises(FileNotFoundError, match="No checkpoint in directory"):
        ckpt.restore(str(tmp_path))
    assert latest_checkpoint(str(tmp_path)) is None


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="at least one object"):
        Checkpoint()
    with pytest.raises(TypeError, match="cannot save an object of type object"):
        Checkpoint(thing=object()).write(str(tmp_path / "x.pt"))
    with pytest.raises(FileNotFoundError, match="No checkpoint file"):
        Checkpoint(m=nn.Linear(1, 1)).read(str(tmp_path / "missing.pt"))
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a phalanx checkpoint"):
        Checkpoint(m=nn.Linear(1, 1)).read(str(tmp_path / "other.pt"))
    path = Checkpoint(a=nn.Linear(1, 1)).write(str(tmp_path / "a.pt"))
    with pytest.raises(ValueError, match=r"has no state for \['b'\]"):
        Checkpoint(a=nn.Linear(1, 1), b=nn.Linear(1, 1)).read(path)
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(Checkpoint(a=nn.Linear(1, 1)), str(tmp_path), max_to_keep=0)
    with pytest.raises(ValueError, match="checkpoint_name"):
        CheckpointManager(Checkpoint(a=nn.Linear(1, 1)), str(tmp_path), checkpoint_name="a/b")


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"format": "phalanx.checkpoint/1", "objects": {"m": Evil()}}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        Checkpoint(m=nn.Linear(1, 1)).read(str(tmp_path / "evil.pt"))


def test_atomic_save_leaves_old_file_when_interrupted(tmp_path, monkeypatch):
    path = str(tmp_path / "state.pt")
    atomic_save({"v": 1}, path)

    def crash(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"v": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_sync_on_read_state_is_saved_aggregated(tmp_path, mirrored_2cpu):
    with mirrored_2cpu.scope():
        bn = nn.BatchNorm1d(3)
    data = [torch.randn(8, 3, generator=torch.Generator().manual_seed(0))]
    for (x,) in [(b,) for b in mirrored_2cpu.experimental_distribute_dataset(data)]:
        mirrored_2cpu.run(lambda t: bn(t), args=(x,))
    comps = bn.running_mean.components
    expected = (comps[0] + comps[1]) / 2
    path = Checkpoint(bn=bn).write(str(tmp_path / "bn.pt"))
    plain = nn.BatchNorm1d(3)
    Checkpoint(bn=plain).read(path)
    torch.testing.assert_close(plain.running_mean, expected)


def test_data_iterator_position_is_saved_and_restored(tmp_path, mirrored_2cpu):
    batches = [torch.full((4, 1), float(i)) for i in range(5)]
    it = iter(mirrored_2cpu.experimental_distribute_dataset(batches))
    next(it)
    next(it)
    path = Checkpoint(data=it).write(str(tmp_path / "it.pt"))
    fresh = iter(mirrored_2cpu.experimental_distribute_dataset(batches))
    Checkpoint(data=fresh).read(path)
    assert mirrored_2cpu.experimental_local_results(next(fresh))[0][0].item() == 2.0
    with pytest.raises(ValueError, match="Cannot rewind"):
        fresh.load_state_dict({"steps": 0})


@pytest.mark.parametrize("number", [-1, "../x", 1.5, True])
def test_a_checkpoint_number_must_be_a_non_negative_integer(tmp_path, number):
    manager = CheckpointManager(Checkpoint(a=nn.Linear(1, 1)), str(tmp_path))
    with pytest.raises(
        ValueError, match=r"checkpoint_number must be a non-negative integer.*Received: .*HINT"
    ):
        manager.save(checkpoint_number=number)
    assert os.listdir(tmp_path) == []
    assert manager.save(checkpoint_number=0).endswith("ckpt-0.pt")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "must be JSON; .* Received: unreadable JSON"),
        ('["ckpt-1.pt"]', r'must be \{"checkpoints": \[file names\]\}; .* Received: \[\'ckpt-1.pt\'\]'),
        ('{"checkpoints": [1]}', r'must be \{"checkpoints": \[file names\]\}'),
        ('{"checkpoints": ["ckpt-1.pt.bak"]}', r"may list only plain names .* Received: 'ckpt-1.pt.bak'"),
    ],
)
def test_a_malformed_index_is_refused_with_the_rule_and_a_hint(tmp_path, content, message):
    (tmp_path / "checkpoint.json").write_text(content)
    with pytest.raises(ValueError, match=f"The checkpoint index .*checkpoint.json {message}.*HINT: "):
        CheckpointManager(Checkpoint(a=nn.Linear(1, 1)), str(tmp_path))


@pytest.mark.parametrize("name", ["..", ".", "a b", ""])
def test_checkpoint_name_must_be_one_plain_component(tmp_path, name):
    with pytest.raises(ValueError, match="checkpoint_name must be a plain file name"):
        CheckpointManager(Checkpoint(a=nn.Linear(1, 1)), str(tmp_path), checkpoint_name=name)


def test_the_index_is_written_atomically_and_leaves_no_temp_file(tmp_path):
    manager = CheckpointManager(Checkpoint(a=nn.Linear(1, 1)), str(tmp_path), max_to_keep=1)
    manager.save()
    manager.save()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.json", "ckpt-2.pt"]


def test_state_dict_moves_every_object_in_memory_and_names_a_missing_one():
    source_model, target_model = nn.Linear(2, 1), nn.Linear(2, 1)
    counter = Counter(7)
    source = Checkpoint(model=source_model, step=counter)
    state = source.state_dict()
    assert sorted(state) == ["model", "step"]
    assert not source.is_sharded
    target_counter = Counter(0)
    Checkpoint(model=target_model, step=target_counter).load_state_dict(state)
    assert torch.equal(target_model.weight, source_model.weight)
    assert target_counter.value == 7
    assert source.save_counter.value == 0  # the state holds the objects only
    with pytest.raises(KeyError, match="optimizer"):
        Checkpoint(model=target_model, optimizer=torch.optim.SGD(target_model.parameters())).load_state_dict(
            state
        )
