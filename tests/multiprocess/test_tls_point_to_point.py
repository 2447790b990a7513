"""Under TLS the job carries point-to-point messages between any two workers, torch groups of
some workers, a 2-D DeviceMesh and a pipeline (`phalanx.communication.transports.tls.peers`,
`TlsTransport.subgroup`), with real worker processes on 127.0.0.1; none of it on plaintext
gloo."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.cluster import LocalCluster, run_cluster

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parent / "scripts" / "tls_point_to_point.py"
TLS = {"PHALANX_COLLECTIVES": "tls", "PHALANX_SHARED_MEMORY": "0"}


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """Every worker's results of one 4-worker run of the script's ``mesh`` mode."""
    out = tmp_path_factory.mktemp("tls-mesh")
    run_cluster(SCRIPT, out, "mesh", workers=4, env=TLS, timeout=480).check()
    return [json.loads((out / f"p2p-{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(600)
def test_send_recv_subgroups_and_a_2d_mesh_run_over_tls(mesh_run):
    results = mesh_run
    assert all(r["uses_tls"] for r in results)
    # tags: received out of the order they were sent, each message where its tag says
    assert results[2]["tags"] == {"3": [3.0] * 3, "1": [1.0] * 3, "2": [2.0] * 3}
    assert results[3]["tags"] == {"3": [13.0] * 3, "1": [11.0] * 3, "2": [12.0] * 3}  # isend/irecv
    assert results[0]["reply"] == [2.0, -1.0]
    assert results[1]["reply"] == [3.0, -1.0]
    assert results[0]["any_source"] == [3, 33.0]  # recv without src returns who sent
    for rank, result in enumerate(results):
        sender = (rank - 2) % 4
        assert result["batch"] == [float(sender), 100.0 + sender]
        partner = (rank + 2) % 4
        assert result["pairs"] == [rank + partner + 2.0, sorted([float(rank), float(partner)])]
        assert result["single"] == 4.0
        # the mesh [[0, 1], [2, 3]]: "pp" joins rank r with r +- 2, "dp" with r ^ 1
        assert result["mesh_pp"] == rank + partner + 2.0
        assert result["mesh_dp"] == rank + (rank ^ 1) + 2.0
    for rank in range(3):
        assert results[rank]["trio"] == [[6.0] * 5, [2.0, 0.0]]
    assert results[2]["trio_p2p"] == 8.0
    assert "trio" not in results[3]  # not a member


@pytest.mark.timeout(600)
def test_a_pipeline_step_over_tls_matches_the_same_step_in_one_process(mesh_run):
    for rank, result in enumerate(mesh_run):
        pipeline = result["pipeline"]
        assert pipeline["stage"] == rank // 2
        assert len(pipeline["grads"]) == 2  # a Linear's weight and bias per stage
        for got, want in zip(pipeline["grads"], pipeline["reference"], strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        if pipeline["loss"] is not None:
            assert pipeline["loss"] == pytest.approx(pipeline["reference_loss"], rel=1e-6)


def test_a_receive_from_a_peer_that_never_sends_times_out_naming_it(tmp_path):
    with LocalCluster(2, env=TLS) as cluster:
        run = cluster.start(SCRIPT, tmp_path, "missing").wait(timeout=180)
        peer = f"worker:1 ({cluster.address('worker-1')})"
    output = run["worker-0"].output
    match = re.search(r"^TIMEOUT (.*)$", output, re.MULTILINE)
    assert match is not None, run.output
    message = match.group(1)
    assert f"recv from {peer} with tag 9" in message, message
    assert "no answer within 4s" in message, message
    assert "RECEIVED" not in output
