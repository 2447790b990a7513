"""TF 2.21 members that need several workers: the preemption handler's agreement on a notice,
PER_REPLICA input and HINT sharding, under MultiWorkerMirroredStrategy in real processes."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import phalanx
from phalanx.checkpoint import Checkpoint

pytestmark = pytest.mark.multiprocess


class _Exited(Exception):
    pass


def _preempted_worker_1_at_step_3(strategy, directory):
    """Worker 1 alone gets the notice before step 3: both must save step 3 and exit there."""
    steps = []

    def notice():
        return strategy.worker_rank == 1 and len(steps) == 3

    def leave():
        raise _Exited

    config = phalanx.experimental.TerminationConfig(termination_watcher_fn=notice, exit_fn=leave)
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        handler = phalanx.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver, Checkpoint(model=model), directory, config
        )
    try:
        for step in range(10):
            handler.run(steps.append, step)
    except _Exited:
        pass
    return {
        "steps": steps,
        "total_run_calls": handler.total_run_calls,
        "files": sorted(os.listdir(directory)),
    }


def test_a_notice_on_one_worker_makes_every_worker_save_the_same_step(mwms_2workers):
    directory = tempfile.mkdtemp(prefix="phalanx-preemption-")
    results = mwms_2workers.run(_preempted_worker_1_at_step_3, directory)
    for result in results:
        assert result["steps"] == [0, 1, 2]
        assert result["total_run_calls"] == 3
    assert "ckpt-3.pt" in results[0]["files"]  # the chief's file (both see the shared folder)


def _per_replica_and_hint(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
        return [torch.full((1,), float(ctx.input_pipeline_id))] * 2

    options = phalanx.InputOptions(experimental_replication_mode="PER_REPLICA")
    first = next(iter(strategy.distribute_datasets_from_function(dataset_fn, options)))
    values = [float(t) for t in strategy.experimental_local_results(first)]
    source = phalanx.data.Dataset.range(8).batch(4)
    hint = phalanx.data.Options()
    hint.experimental_distribute.auto_shard_policy = phalanx.data.experimental.AutoShardPolicy.HINT
    seen = []
    for batch in strategy.experimental_distribute_dataset(source.with_options(hint)):
        for part in strategy.experimental_local_results(batch):
            seen += part.tolist()
    return {"contexts": contexts, "values": values, "hint_seen": sorted(seen)}


def test_per_replica_input_and_hint_sharding_across_workers(mwms_2workers):
    results = mwms_2workers.run(_per_replica_and_hint, strategy_kwargs={"devices": ["cpu:0", "cpu:1"]})
    assert results[0]["contexts"] == [(4, 0), (4, 1)]
    assert results[1]["contexts"] == [(4, 2), (4, 3)]
    assert results[1]["values"] == [2.0, 3.0]
    for result in results:  # HINT: nothing sharded, every worker reads all 8 elements
        assert result["hint_seen"] == list(range(8))
