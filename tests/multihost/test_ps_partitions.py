"""ParameterServer training across 5 simulated hosts (chief, 2 workers, 2 ps) through network
partitions: a worker cut off mid-training is lost, its functions rerun elsewhere, and it serves
again once the link heals, with every example counted once; a ps cut off fails the steps that
need it with an error naming it, within a bound."""

from __future__ import annotations

import json
import re
import time

import pytest

from multihost.cluster import PORT, start_cluster, wait_all, wait_for

pytestmark = pytest.mark.multihost

TASKS = [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("ps", 1)]  # host i runs TASKS[i]
BATCH = 8  # the script's batch size
PS_CALL_TIMEOUT = 20  # seconds: a call to a cut-off ps task fails after this (a slow start under load fits)
TOKEN = "multihost-ps-token-0123456789abcdef"


def _start(hosts, mode):
    return start_cluster(
        hosts,
        TASKS,
        "ps_across_hosts.py",
        [mode],
        PHALANX_CLUSTER_TOKEN=TOKEN,
        PHALANX_PS_CALL_TIMEOUT_SECONDS=str(PS_CALL_TIMEOUT),
    )


def _assert_listens_at_its_own_address_only(host):
    """The task's gRPC server binds the address the cluster spec gives it (gRPC may spell it
    as an IPv4-mapped IPv6 address), not every interface."""
    listening = host.run(["ss", "-ltnH"], name="ss").wait(30)[1]
    ports = re.findall(rf"(\S+):{PORT}\s", listening)
    assert ports, listening
    assert all(a in (host.address, f"[::ffff:{host.address}]") for a in ports), listening


def _line(output, prefix):
    return next(line.split(f"{prefix} ", 1)[1] for line in output.splitlines() if f"] {prefix} " in line)


def test_a_worker_cut_off_mid_training_is_lost_rerun_recovered_and_every_example_counts_once(make_hosts):
    hosts = make_hosts(5)
    tasks = _start(hosts, "worker-cut")
    chief, processes = tasks["chief:0"], list(tasks.values())
    wait_for(lambda: "] STEPPING" in chief.output, 150, processes, "training on both workers")
    _assert_listens_at_its_own_address_only(hosts[1])
    code, _ = hosts[1].run(["getent", "hosts", hosts[1].hostname], name="getent").wait(30)
    assert code == 2  # its host name resolves nowhere: the cluster runs on addresses alone
    hosts[1].cut()
    wait_for(lambda: "] LOST [0]" in chief.output, 30, processes, "the coordinator to count worker:0 lost")
    time.sleep(2.0)  # its functions run on worker:1 meanwhile
    hosts[1].heal()
    codes, output = wait_all([chief], timeout=90)
    assert codes == [0], output
    assert "] BACK" in output
    assert "Lost worker:0 (" in output  # the coordinator's warning: its function runs elsewhere
    result = json.loads(_line(output, "RESULT"))
    assert result["used_after"] == [0, 1]  # the healed worker trains again
    assert result["examples"] == result["steps"] * BATCH  # exactly once: no step lost, none twice


def test_a_ps_cut_off_fails_the_steps_that_need_it_naming_it_within_a_bound(make_hosts):
    hosts = make_hosts(5)
    tasks = _start(hosts, "ps-cut")
    chief, processes = tasks["chief:0"], list(tasks.values())
    wait_for(lambda: "] STEPPING" in chief.output, 150, processes, "training on both workers")
    hosts[3].cut()
    cut_at = time.time()
    codes, output = wait_all([chief], timeout=PS_CALL_TIMEOUT + 60)
    assert codes == [0], output
    raised_at, error = _line(output, "ERROR").split(" ", 1)
    assert float(raised_at) - cut_at <= PS_CALL_TIMEOUT + 15  # the call deadline, not a hang
    assert error.startswith("TaskUnavailableError: ps:0 (")
    assert f"{hosts[3].address}:{PORT}" in error
    assert f"within the {PS_CALL_TIMEOUT}s deadline" in error
