"""A parameter-server cluster of real processes on 127.0.0.1: chief, 2 workers, 2 ps (gRPC)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import phalanx
from support.cluster import run_cluster

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"


def _run(tmp_path, mode):
    run = run_cluster(SCRIPTS / "ps_checks.py", tmp_path, mode, chief=True, workers=2, ps=2, timeout=240)
    run.check()  # the chief's code: the workers and ps serve until it is done, then are stopped
    return json.loads((tmp_path / "ps.json").read_text()), run.output


def _ps_pid(cluster_spec):
    """The pid of this cluster's ps task: the process whose TF_CONFIG names it."""
    for stat in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = dict(e.split(b"=", 1) for e in stat.read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        config = json.loads(env.get(b"TF_CONFIG", b"{}"))
        if config.get("cluster") == cluster_spec and config["task"]["type"] == "ps":
            return int(stat.parent.name)
    raise RuntimeError("no ps task found")


def _kill_the_ps_task(strategy):
    """(chief) Trains a step, kills the ps task, schedules another: what join() raised, how soon."""
    coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        def replica_fn():
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()

        strategy.run(replica_fn)
        return strategy.worker_index

    worker = coordinator.schedule(step).fetch()
    os.kill(_ps_pid(strategy.cluster_resolver.cluster_spec().as_dict()), signal.SIGKILL)
    started = time.monotonic()
    coordinator.schedule(step)
    try:
        coordinator.join()
    except Exception as exc:  # the test checks which error it is
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    return {"worker": worker, "error": error, "seconds": time.monotonic() - started}


def test_training_is_asynchronous_on_every_worker_and_the_variables_live_on_the_ps_tasks(tmp_path):
    result, _ = _run(tmp_path, "train")
    assert result["placement"] == [0, 1]  # round-robin over both ps tasks
    assert result["workers_used"] == [0, 1]
    assert result["held_out_after"] < 0.5 * result["held_out_before"]
    # the coordinator's copies were refreshed from the ps tasks
    assert not result["unchanged"], f"still at their initial values after 80 steps: {result['unchanged']}"
    assert result["running_mean_moved"]
    assert result["num_batches_tracked"] == 80  # every worker's BatchNorm update arrived
    assert result["bias_seen_by_worker"] == 123.0


def test_model_fit_trains_on_every_worker_process(tmp_path):
    result, _ = _run(tmp_path, "fit")
    assert result["losses"][-1] < result["losses"][0]
    assert result["examples_counted"] == 256  # the last epoch's metric updates all reached the ps


def test_a_failing_function_cancels_the_queued_ones_and_join_raises_its_error(tmp_path):
    result, _ = _run(tmp_path, "error")
    assert "a bad batch" in result["join_raised"]
    assert result["statuses"][0] == "ABORTED"
    assert result["usable_after"]


def test_a_killed_worker_is_replaced_by_the_others(tmp_path):
    result, out = _run(tmp_path, "kill-worker")
    assert result["finished"] == 20
    assert result["workers_after_kill"] == [0]
    assert "Lost worker:1" in out


def test_a_killed_ps_task_is_an_error_that_names_it(ps_2workers_1ps):
    (result,) = ps_2workers_1ps.run(_kill_the_ps_task)
    assert result["worker"] in (0, 1)  # the first step ran on a worker process
    assert "ps:0" in result["error"]
    assert result["seconds"] < 120
