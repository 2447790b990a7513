"""MultiWorkerMirroredStrategy across simulated hosts whose names resolve nowhere.

Each worker runs on a host of its own (own network namespace, host name, /dev/shm, PIDs), so
gloo must bind the address TF_CONFIG gives the task, and the workers talk over the bridge,
never through shared memory. The numbers are the TF reference trajectories'.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

import phalanx
from multihost.cluster import SCRIPTS, base_env, start_workers, wait_all, worker_cluster
from support import oracle

pytestmark = pytest.mark.multihost
TOKEN = "multihost-mwms-token-0123456789abcdef"
IDS = ["ipv4", "ipv6", "ipv4-tls", "ipv6-tls"]


def _results(out_dir, workers):
    results = [json.loads((out_dir / f"result-{r}.json").read_text()) for r in range(workers)]
    states = [torch.load(out_dir / f"state-{r}.pt")["state"] for r in range(workers)]
    return results, states


def _four_replica_run(n):
    strategy = phalanx.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    try:
        return oracle.run_ctl(strategy, n=n)
    finally:
        strategy._threads.close()


@pytest.mark.parametrize(
    ("ipv6", "token"), [(False, None), (True, None), (False, TOKEN), (True, TOKEN)], ids=IDS
)
def test_two_hosts_reproduce_tf_multi_worker_trajectory(make_hosts, tmp_path, ipv6, token):
    hosts = make_hosts(2, ipv6=ipv6)
    n = 256 if not ipv6 else 64  # IPv6: the first two steps suffice
    env = {"PHALANX_CLUSTER_TOKEN": token} if token else {}
    codes, output = wait_all(start_workers(hosts, "ctl_oracle.py", [tmp_path, n], **env), timeout=180)
    assert codes == [0, 0], output
    assert "loopback address as fallback" not in output
    # with a token, the collectives between the hosts go over mutual TLS; without, gloo says so
    assert ("PLAINTEXT gloo" in output) is (token is None), output
    results, states = _results(tmp_path, 2)
    assert all(r["tls"] is (token is not None) for r in results)
    ref, meta = oracle.reference("ctl_mirrored")
    steps = n // oracle.GLOBAL_BATCH
    for r, host in enumerate(hosts):
        assert results[r]["hostname"] == host.hostname
        assert results[r]["gloo_interface"] == "eth0"  # the interface that holds the task's address
        assert not results[r]["shared_memory"]  # another host's /dev/shm is not this one's
        np.testing.assert_allclose(results[r]["losses"], ref["losses"][:steps], **oracle.LOSS_TOL)
        if n == 256:
            for name, value in states[r].items():
                np.testing.assert_allclose(value.numpy(), ref[f"final/torch/{name}"], **oracle.WEIGHT_TOL)
    assert [results[0]["seen"][0][0], results[1]["seen"][0][0]] == meta["replica_indices_per_step"][0]


def test_four_hosts_equal_four_replicas_in_one_process(make_hosts, tmp_path):
    hosts = make_hosts(4)
    n = 128
    workers = start_workers(hosts, "ctl_oracle.py", [tmp_path, n], PHALANX_CLUSTER_TOKEN=TOKEN)
    codes, output = wait_all(workers, timeout=240)
    assert codes == [0, 0, 0, 0], output
    results, states = _results(tmp_path, 4)
    losses, state, seen = _four_replica_run(n)
    for r in range(4):
        assert results[r]["tls"]  # a ring of 4 mutual-TLS connections across the bridge
        assert results[r]["replicas"] == 4
        np.testing.assert_allclose(results[r]["losses"], losses, rtol=1e-6, atol=1e-6)
        assert [s[0] for s in results[r]["seen"]] == [s[r] for s in seen]
        for name, value in state.items():
            np.testing.assert_allclose(states[r][name].numpy(), value.numpy(), rtol=1e-6, atol=1e-6)


def test_the_launchers_per_node_mode_on_each_host(make_hosts, tmp_path):
    """``phalanx launch --tf-config ... --node <address>`` on each of 2 hosts, 2 workers per host."""
    hosts = make_hosts(2)
    cluster = worker_cluster(hosts, per_host=2)
    n = 128
    launch = [sys.executable, "-m", "phalanx", "launch", "--tf-config", json.dumps({"cluster": cluster})]
    script = [str(SCRIPTS / "ctl_oracle.py"), str(tmp_path), str(n)]
    launches = [
        host.run(
            [*launch, "--node", host.address, "--timeout", "200", *script],
            base_env(),
            name=f"node-{host.index}",
        )
        for host in hosts
    ]
    codes, output = wait_all(launches, timeout=240)
    assert codes == [0, 0], output
    for rank in range(4):  # each host's launcher prefixes its tasks' lines
        assert f"[node-{rank // 2}] [worker-{rank}] done {rank} 4" in output
    results, states = _results(tmp_path, 4)
    assert [r["hostname"] for r in results] == [hosts[0].hostname] * 2 + [hosts[1].hostname] * 2
    assert not any(r["shared_memory"] for r in results)  # shared memory needs every worker on one host
    losses, state, _ = _four_replica_run(n)
    for r in range(4):
        np.testing.assert_allclose(results[r]["losses"], losses, rtol=1e-6, atol=1e-6)
        for name, value in state.items():
            np.testing.assert_allclose(states[r][name].numpy(), value.numpy(), rtol=1e-6, atol=1e-6)
