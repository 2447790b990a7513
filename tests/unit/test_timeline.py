"""PHALANX_TIMELINE: a Chrome trace per task with forward, backward and optimizer spans."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import phalanx
from phalanx import timeline


@pytest.fixture
def recording(tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    path = timeline.start(tmp_path / "trace.json")
    yield path
    timeline.stop()


def _events(path):
    return json.loads(path.read_text())["traceEvents"]


def test_a_mirrored_step_is_traced_on_each_replica_thread(recording):
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(3):
        strategy.run(step, args=(torch.randn(2, 4),))
    assert timeline.stop() == recording
    events = _events(recording)
    spans = [e for e in events if e["ph"] == "X"]
    names = [e["name"] for e in spans]
    # one forward per replica per step (the outermost module only, not each layer)
    assert names.count("forward Sequential") == names.count("backward") == names.count("SGD.step") == 6
    assert len({e["tid"] for e in spans}) == 2  # the two replica threads
    assert all(e["dur"] >= 0 for e in spans)
    process = next(e for e in events if e["name"] == "process_name")
    assert process["args"]["name"] == "local"
    assert not timeline.is_enabled()


def test_the_file_is_named_after_the_task(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {}, "task": {"type": "worker", "index": 1}}))
    assert timeline.task_name() == "worker-1"
    try:
        assert timeline.start(tmp_path / "t.json") == tmp_path / "t.worker-1.json"
        with timeline.span("my span", "user", {"bytes": 4}):
            pass
    finally:
        timeline.stop()
    [mine] = [e for e in _events(tmp_path / "t.worker-1.json") if e["name"] == "my span"]
    assert mine["cat"] == "user"
    assert mine["args"] == {"bytes": 4}
    monkeypatch.delenv("TF_CONFIG")
    monkeypatch.setenv("RANK", "3")
    assert timeline.task_name() == "rank-3"


def test_spans_are_free_and_nothing_is_written_while_off(tmp_path):
    assert not timeline.is_enabled()
    assert timeline.span("x") is timeline.span("y")  # one shared no-op
    assert timeline.write() is None
    assert timeline.stop() is None
    assert torch.Tensor.backward is timeline._original_backward


def test_start_without_a_path_names_the_variable(monkeypatch):
    monkeypatch.delenv("PHALANX_TIMELINE", raising=False)
    with pytest.raises(ValueError, match="PHALANX_TIMELINE=/tmp/trace.json"):
        timeline.start()


def test_events_beyond_the_cap_are_counted_not_kept(recording, monkeypatch):
    monkeypatch.setattr(timeline, "MAX_EVENTS", 2)
    for i in range(5):
        with timeline.span(f"s{i}"):
            pass
    timeline.write()
    events = _events(recording)
    assert [e["name"] for e in events if e["ph"] == "X"] == ["s0", "s1"]
    assert "(3 events dropped)" in next(e for e in events if e["name"] == "process_name")["args"]["name"]
