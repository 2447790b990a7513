"""train_and_evaluate on a cluster of real processes: chief, worker and ps from TF_CONFIG, and an
evaluator task outside the cluster spec (as TF), all running examples/estimator_train_and_evaluate.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import phalanx
from support.cluster import LocalCluster, run_python

pytestmark = pytest.mark.multiprocess
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "estimator_train_and_evaluate.py"


def test_train_and_evaluate_runs_each_role_of_the_cluster(tmp_path):
    model_dir = tmp_path / "model"
    args = ["--model-dir", model_dir, "--max-steps", 200]
    with LocalCluster(workers=1, chief=True, ps=1) as cluster:
        cluster.start(EXAMPLE, *args)
        config = {"cluster": cluster.spec, "task": {"type": "evaluator", "index": 0}}
        env = {"TF_CONFIG": json.dumps(config), "PHALANX_CLUSTER_TOKEN": cluster.env["PHALANX_CLUSTER_TOKEN"]}
        evaluator = run_python(EXAMPLE, *args, env=env, timeout=240)
        run = cluster.wait(240, names=["chief-0", "worker-0"])
    run.check("chief-0", "worker-0")
    assert "chief done; evaluation: None" in run["chief-0"].output
    assert "worker done; evaluation: None" in run["worker-0"].output
    assert run["ps-0"].returncode != 0  # it served until it was stopped
    assert evaluator.returncode == 0, evaluator.stdout[-3000:] + evaluator.stderr[-3000:]
    accuracy, step = re.search(r"accuracy (\S+) at global step (\d+)", evaluator.stdout).groups()
    assert int(step) >= 200  # it evaluated until the last checkpoint
    assert float(accuracy) > 0.7
    # It evaluated the chief's final checkpoint. The file is named after the global step the
    # chief read before writing; the worker may have added one more step by then (asynchronous
    # training, as TF's saver), and the evaluator reports the step the file holds.
    latest = phalanx.checkpoint.latest_checkpoint(str(model_dir))
    saved_step = phalanx.checkpoint.Counter()
    phalanx.checkpoint.Checkpoint(global_step=saved_step).read(latest)
    assert saved_step.value == int(step), (latest, saved_step)
    named_step = int(re.search(r"model\.ckpt-(\d+)\.pt$", latest).group(1))
    assert 200 <= named_step <= saved_step.value
    assert list(model_dir.glob("events.out.tfevents.*"))  # the chief's training summaries
    assert list((model_dir / "eval").glob("events.out.tfevents.*"))  # the evaluator's
