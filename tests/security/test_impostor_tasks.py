"""An impostor at a task's address: it never gets the token, and nothing it sends is unpickled.

Real processes: a parameter-server cluster (chief, worker, ps) on 127.0.0.1 in which one
task's address is held by the test's `Impostor` (a real gRPC server without the token,
plaintext or TLS with its own CA) whose every reply would write a canary file when unpickled.
Each test proves that nothing ran (no canary), nothing leaked (the impostor received no call:
no token, no request body) and nothing hung (the chief names the impostor and exits).
"""

from __future__ import annotations

import pytest

from security.helpers import SCRIPTS
from security.impostor import Impostor
from support.cluster import LocalCluster

pytestmark = pytest.mark.multiprocess
SCRIPT = SCRIPTS / "ps_task_with_impostor.py"
TIMEOUT = 180  # three tasks importing torch on a loaded machine, then the chief's error


def _run_with_impostor(tmp_path, task: str, tls: bool, env: dict[str, str] | None = None):
    canary, log = tmp_path / "canary.txt", tmp_path / "impostor-calls.jsonl"
    with LocalCluster(1, chief=True, ps=1, env=env) as cluster:
        impostor = Impostor(cluster.address(task), canary, log, tls=tls)
        try:
            run = cluster.start(SCRIPT, task).wait(TIMEOUT)
        finally:
            impostor.stop()
        return run, impostor, cluster.env["PHALANX_CLUSTER_TOKEN"]


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("tls", [False, True], ids=["plaintext-impostor", "tls-impostor-own-ca"])
@pytest.mark.parametrize(("task", "name"), [("worker-0", "worker:0"), ("ps-0", "ps:0")])
def test_an_impostor_task_gets_nothing_and_its_reply_is_never_unpickled(tmp_path, task, name, tls):
    run, impostor, token = _run_with_impostor(tmp_path, task, tls)
    chief = run["chief-0"]
    assert chief.returncode == 3, run.output  # it ended, with an error, instead of hanging
    assert f"chief error: PeerAuthenticationError: {name} " in chief.output, run.output
    assert "did not prove that it holds this cluster's credentials" in chief.output
    assert not impostor.canary.exists()  # nothing the impostor sent was unpickled
    assert impostor.calls() == []  # not one request reached it: no token, no pickled function
    assert token not in run.output


@pytest.mark.timeout(TIMEOUT + 60)
def test_the_canary_works_the_plaintext_opt_out_trusts_whoever_holds_the_address(tmp_path):
    """The control: with PHALANX_INSECURE_TRANSPORT=1 (trusted networks only) the same impostor
    worker receives the token and its reply runs code on the chief, which is what TLS stops."""
    run, impostor, token = _run_with_impostor(
        tmp_path, "worker-0", tls=False, env={"PHALANX_INSECURE_TRANSPORT": "1"}
    )
    assert impostor.canary.exists(), run.output
    assert any(["phalanx-token", token] in call["metadata"] for call in impostor.calls())
    assert "uses PLAINTEXT gRPC (PHALANX_INSECURE_TRANSPORT=1)" in run.output
