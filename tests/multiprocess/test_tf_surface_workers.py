"""TF 2.21 members that need several workers: PER_REPLICA input and HINT sharding, under
MultiWorkerMirroredStrategy in real processes (the preemption handler's agreement on a notice
is tests/faults/test_preemption.py)."""

from __future__ import annotations

import pytest
import torch

import phalanx

pytestmark = pytest.mark.multiprocess


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
