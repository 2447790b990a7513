"""``phalanx launch`` arguments and the usage errors caught before any process starts."""

from __future__ import annotations

import argparse
import re

import pytest

from phalanx.cluster import launch, launch_node
from phalanx.cluster.launcher import add_launch_arguments, run_launch


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="phalanx launch")
    add_launch_arguments(parser)
    return parser.parse_args(argv)


def test_parsing_keeps_the_scripts_own_options():
    ns = _parse("--workers", "3", "--ps", "1", "--chief", "--timeout", "9", "train.py", "--lr", "0.1")
    assert (ns.workers, ns.ps, ns.chief, ns.timeout) == (3, 1, True, 9.0)
    assert (ns.script, ns.script_args) == ("train.py", ["--lr", "0.1"])
    ns = _parse("--tf-config", "{}", "--task", "worker:0", "--task", "ps:1", "t.py")
    assert ns.task == ["worker:0", "ps:1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "2", "--nproc-per-node", "3", "t.py"], "must be >= 1 and equal workers"),
        (["--chief", "--workers", "2", "--nproc-per-node", "2", "t.py"], "chief=True, nproc_per_node=2"),
        (["--nproc-per-node", "0", "t.py"], "nproc_per_node=0"),
        (["--node", "n1", "t.py"], "no --tf-config was given"),
        (["--tf-config", '{"worker": ["a:1"]}', "--workers", "2", "t.py"], r"Received also: \['--workers'\]"),
        (
            ["--tf-config", '{"worker": ["a:1"]}', "--node", "a", "--task", "worker:0", "t.py"],
            "--node', '--task'",
        ),
        (["--tf-config", '{"worker": ["a:1"]}', "--task", "worker", "t.py"], "--task must be JOB:INDEX"),
        (["--tf-config", "{bad", "--node", "a", "t.py"], "--tf-config is not valid JSON"),
        (
            ["--tf-config", '{"worker": ["a:1"]}', "--node", "a", "--nproc-per-node", "2", "t.py"],
            r"\(1: \['worker-0'\]\)",
        ),
        (["--timeout", "0", "t.py"], "timeout must be a positive number"),
        (["missing_script.py"], "must be an existing script"),
    ],
)
def test_usage_errors_exit_2_with_the_rule(capsys, argv, message):
    assert run_launch(_parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx launch: error: ")
    assert re.search(message, err), err


def test_the_python_api_raises_the_same_errors():
    with pytest.raises(ValueError, match="equal workers"):
        launch("t.py", workers=1, nproc_per_node=3)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        launch_node("t.py", {"worker": ["a:1"]}, node_tasks="a", timeout=-1)


def test_a_missing_interpreter_is_named(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(
        ValueError, match="Could not start task worker-0: .* HINT: check the python= argument"
    ):
        launch(script, workers=1, python=str(tmp_path / "no-python"))


def test_a_status_page_off_loopback_needs_a_token_the_user_chose(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("PHALANX_CLUSTER_TOKEN", raising=False)
    script = tmp_path / "t.py"
    script.write_text("")
    assert run_launch(_parse("--status", "0.0.0.0:0", str(script))) == 2
    err = capsys.readouterr().err
    assert "A status page off loopback requires the cluster token" in err
    assert "Received: --status 0.0.0.0:0 and no PHALANX_CLUSTER_TOKEN" in err


def test_a_malformed_status_address_is_a_usage_error(capsys, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    assert run_launch(_parse("--status", "8265", str(script))) == 2
    assert "--status must be HOST:PORT" in capsys.readouterr().err


def test_per_node_status_tells_the_tasks_where_the_chief_serves(monkeypatch):
    seen = {}

    def fake_launch_node(script, cluster, **kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr("phalanx.cluster.launcher.launch_node", fake_launch_node)
    ns = _parse("--tf-config", '{"worker": ["a:1"]}', "--node", "a", "--status", "a:8265", "t.py")
    assert run_launch(ns) == 0
    assert seen["env"] == {"PHALANX_STATUS_ADDRESS": "a:8265"}
