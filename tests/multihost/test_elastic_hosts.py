"""An elastic MultiWorkerMirrored job across simulated hosts: one host is cut off mid-training
(its link down) and healed; the survivors re-form without it and train on; the cut worker,
told it was left out, exits; restarted, it joins again; every member ends with the same
weights. The store outlives the workers (its own process, as ``phalanx launch`` serves it on
one machine); the other-launcher variables (docs/multi_worker.md, Elastic training)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from multihost.cluster import PORT, SCRIPTS, base_env, tf_config, wait_all, wait_for, worker_cluster

pytestmark = pytest.mark.multihost

FIT = Path(__file__).resolve().parents[1] / "faults" / "scripts" / "elastic_fit.py"
EPOCHS, PAUSE = 3, 0.3  # 150 steps, 45 s of training at least: the cut worker can come back in time
CUT_SECONDS = 5.0  # how long the host stays cut off
RECOVERY_BOUND = 15.0  # seconds from the cut to the survivors' next completed step (the issue's bound)
TOKEN = "multihost-elastic-token-0123456789abcdef"


def test_a_cut_off_host_is_left_behind_and_taken_back_after_healing(make_hosts, tmp_path):
    hosts = make_hosts(3)
    store_port = PORT + 50
    store = hosts[0].run(
        [sys.executable, str(SCRIPTS / "elastic_store.py"), hosts[0].address, str(store_port)],
        base_env(),
        name="store",
    )
    cluster = worker_cluster(hosts)
    env = {
        "PHALANX_CLUSTER_TOKEN": TOKEN,
        "PHALANX_MIN_WORKERS": "2",
        "PHALANX_ELASTIC_STORE": f"{hosts[0].url_host}:{store_port}",
        "PHALANX_ELASTIC_DEAD_SECONDS": "2",  # a cut host's beacon stops: lost after 2 s
        "PHALANX_HEARTBEAT_TIMEOUT_SECONDS": "5",  # the cut worker gives up on its group sooner
    }

    def start(index: int, incarnation: int = 0):
        variables = base_env(
            TF_CONFIG=tf_config(cluster, "worker", index), PHALANX_ELASTIC_INCARNATION=str(incarnation), **env
        )
        argv = [sys.executable, str(FIT), str(tmp_path), str(EPOCHS), "-1", "-1", str(PAUSE)]
        return hosts[index].run(argv, variables, name=f"worker-{index}.{incarnation}")

    workers = [start(i) for i in range(3)]
    processes = [store, *workers]
    try:
        wait_for(lambda: (tmp_path / "backup").exists(), 180, workers, "the first steps on every host")
        hosts[2].cut()
        cut_at = time.time()
        time.sleep(CUT_SECONDS)
        hosts[2].heal()
        code, cut_output = workers[2].wait(90)  # it was left out: it says so and exits
        assert code is not None, f"the cut worker still ran 90 s after healing:\n{cut_output}"
        assert code != 0, cut_output
        rejoined = start(2, incarnation=1)
        processes.append(rejoined)
        codes, output = wait_all([workers[0], workers[1], rejoined], timeout=300)
    finally:
        for process in processes:
            process.kill()
    assert codes == [0, 0, 0], output
    assert "was left out of membership epoch" in cut_output, cut_output
    results = {p.stem: torch.load(p) for p in sorted(tmp_path.glob("weights-*.pt"))}
    assert sorted(results) == ["weights-0-0", "weights-1-0", "weights-2-1"], output
    first = results["weights-0-0"]["weights"]
    for name, result in results.items():
        for key, value in result["weights"].items():
            assert torch.equal(value, first[key]), (name, key)  # identical on every member
        assert result["run_count"] == 50 * EPOCHS  # every step once
        assert result["workers"] == 3  # the healed host trains again
    survivor_times = results["weights-0-0"]["times"]
    recovery = min(t for t in survivor_times if t > cut_at) - cut_at
    print(f"host cut off: the survivors' next step completed {recovery:.2f}s after the cut")
    assert recovery < RECOVERY_BOUND, output
    assert "left: ['worker:2 (" in output  # the new chief logs who left, and who joined again
    assert "joined: ['worker:2 (" in output
