"""The launcher's side of an elastic job: its arguments, the store it serves, the lost
trainers it marks and restarts, and when the job fails (`phalanx.cluster.elastic`)."""

from __future__ import annotations

import argparse
import errno
import socket

import pytest
import torch.distributed as dist

from phalanx.cluster import elastic as elastic_module
from phalanx.cluster import launch
from phalanx.cluster._supervisor import Outcome, TaskState
from phalanx.cluster.elastic import ElasticLaunch
from phalanx.cluster.launcher import add_launch_arguments, run_launch
from phalanx.communication.membership.membership import PREFIX
from phalanx.communication.membership.rendezvous import AuthenticatedStore
from phalanx.communication.transports.interfaces import interface_addresses

TOKEN = "t" * 32


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="phalanx launch")
    add_launch_arguments(parser)
    return parser.parse_args(argv)


def test_the_options_are_parsed():
    ns = _parse("--workers", "3", "--min-workers", "2", "--max-restarts", "4", "train.py")
    assert (ns.workers, ns.min_workers, ns.max_restarts) == (3, 2, 4)
    assert (_parse("train.py").min_workers, _parse("train.py").max_restarts) == (None, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": 3, "max_restarts": 1}, "no --min-workers was given"),
        ({"workers": 2, "min_workers": 3}, "1 <= --min-workers <= the workers"),
        ({"workers": 2, "min_workers": 0}, "1 <= --min-workers <= the workers"),
        ({"workers": 2, "min_workers": 1, "max_restarts": -1}, "--max-restarts >= 0"),
        ({"workers": 2, "ps": 1, "min_workers": 1}, "no ps tasks"),
    ],
)
def test_contradicting_options_are_refused_before_any_process_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch("never_started.py", **kwargs)


def test_per_node_mode_refuses_min_workers(capsys):
    code = run_launch(_parse("--tf-config", '{"worker": ["127.0.0.1:1"]}', "--min-workers", "1", "t.py"))
    assert code == 2
    assert "--min-workers runs an elastic job in local mode only" in capsys.readouterr().err


@pytest.fixture
def launch_side():
    notes: list[str] = []
    elastic = ElasticLaunch(2, 1, TOKEN, notes.append)
    yield elastic, notes
    elastic.close()


def _store(elastic: ElasticLaunch):
    host, _, port = elastic.address.rpartition(":")
    client = dist.TCPStore(host, int(port), None, is_master=False)
    return AuthenticatedStore(dist.PrefixStore(PREFIX, client), TOKEN, PREFIX)


def _trainer(name: str, code: int | None) -> TaskState:
    return TaskState(name, True, code)


def test_the_tasks_learn_the_store_and_the_minimum_and_shared_memory_stays_on(launch_side):
    elastic, _ = launch_side
    env = elastic.environment()
    assert env["PHALANX_MIN_WORKERS"] == "2"
    assert env["PHALANX_ELASTIC_STORE"] == elastic.address
    assert "PHALANX_SHARED_MEMORY" not in env  # the user's choice, on by default
    assert elastic.incarnation_env("worker-1") == {"PHALANX_ELASTIC_INCARNATION": "0"}


def test_the_store_listens_on_the_loopback_address_only_as_ipv4(launch_side):
    """Not on every interface, nor as an IPv6 socket, whose clients' v4-mapped addresses the
    store's server looks up in DNS on its one event loop (no /etc/hosts line for 127.0.0.1
    answers them): an unanswered query held every worker's calls for 5 s."""
    elastic, _ = launch_side
    port = int(elastic.address.rpartition(":")[2])
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # where the workers reach it
    others = [a for _, a in interface_addresses() if a != "127.0.0.1" and not a.startswith("fe80:")]
    if not others:
        pytest.skip("no address here besides 127.0.0.1")
    for address in others:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
            probe.settimeout(5)
            assert probe.connect_ex((address, port)) == errno.ECONNREFUSED, address  # nobody listens there


def test_a_lost_trainer_is_marked_logged_and_restarted_once(launch_side):
    elastic, notes = launch_side
    restarted: list[str] = []
    states = [
        (_trainer("worker-0", None), 10, 0),
        (_trainer("worker-1", -9), 11, 1),
        (_trainer("worker-2", None), 12, 2),
    ]
    elastic.handle_exits(states, restarted.append)
    elastic.handle_exits(states, restarted.append)  # the same exit is handled once
    assert restarted == ["worker-1"]
    assert _store(elastic).get("alive/1") == b"dead"
    assert elastic.incarnation_env("worker-1") == {"PHALANX_ELASTIC_INCARNATION": "1"}
    assert any("worker-1 left at" in n and "killed by SIGKILL" in n for n in notes)
    assert any("restarting worker-1 (restart 1 of 1)" in n for n in notes)
    # the replacement dies too: no restart is left, so it leaves the job
    elastic.handle_exits([(_trainer("worker-1", 1), 13, 1)], restarted.append)
    assert restarted == ["worker-1"]
    kept = elastic.kept([_trainer("worker-0", None), _trainer("worker-1", 1), _trainer("worker-2", None)])
    assert [s.name for s in kept] == ["worker-0", "worker-2"]
    assert elastic.decide(kept) is None  # two are left: the minimum


def test_below_the_minimum_the_survivors_get_a_grace_period_then_the_job_fails(launch_side, monkeypatch):
    elastic, _ = launch_side
    elastic.max_restarts = 0
    elastic.handle_exits([(_trainer("worker-1", -9), 11, 1)], lambda name: None)
    running = elastic.kept([_trainer("worker-0", None), _trainer("worker-1", -9)])
    assert elastic.decide(running) is None  # worker-0 stops with BelowMinimumWorkersError itself
    monkeypatch.setattr(elastic_module, "BELOW_MINIMUM_GRACE", 0.0)
    decision = elastic.decide(running)
    assert decision is not None
    assert decision.outcome is Outcome.FAILED
    assert "fewer than --min-workers 2 workers are left" in decision.message


def test_below_the_minimum_the_job_fails_once_every_survivor_exited(launch_side):
    elastic, _ = launch_side
    elastic.max_restarts = 0
    elastic.handle_exits(
        [(_trainer("worker-1", -9), 11, 1), (_trainer("worker-0", 1), 10, 0)], lambda n: None
    )
    decision = elastic.decide(elastic.kept([_trainer("worker-0", 1), _trainer("worker-1", -9)]))
    assert decision is not None
    assert decision.exit_code == 1


def test_no_restart_once_a_trainer_finished(launch_side):
    elastic, notes = launch_side
    restarted: list[str] = []
    elastic.handle_exits(
        [(_trainer("worker-0", 0), 10, 0), (_trainer("worker-1", -6), 11, 1)], restarted.append
    )
    assert restarted == []  # the job is ending: a replacement could never be admitted
    assert elastic.kept([_trainer("worker-0", 0), _trainer("worker-1", -6)]) == [_trainer("worker-0", 0)]
    assert any("worker-1 left at" in n and "SIGABRT" in n for n in notes)
