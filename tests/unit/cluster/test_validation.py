"""Validation rules beside the catalogue of bad TF_CONFIGs (tests/security/test_malformed_cluster.py)."""

from __future__ import annotations

import json
import re
import socket
import threading

import pytest

from phalanx.cluster import ClusterSpec, SimpleClusterResolver, TFConfigClusterResolver, _hosts
from phalanx.cluster._hosts import resolve_host
from phalanx.cluster.validation import (
    parse_tf_config,
    validate,
    validate_for_strategy,
    validate_resolved_addresses,
)

W2 = {"worker": ["a:1", "a:2"]}


def _config(cluster=None, task=None, **extra):
    config = {"cluster": cluster if cluster is not None else W2, **extra}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


def test_messages_carry_a_hint_where_a_fix_is_not_obvious(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _config())
    with pytest.raises(ValueError, match='HINT: add "task": {"type": "worker", "index": 0}'):
        TFConfigClusterResolver()


def test_an_evaluator_need_not_be_listed_in_the_cluster():
    resolver = TFConfigClusterResolver(tf_config=_config(task={"type": "evaluator", "index": 0}))
    assert resolver.task_type == "evaluator"
    assert not resolver.is_chief


def test_blank_config_is_a_single_process():
    config = parse_tf_config("  ")
    assert (config.cluster, config.task_type, config.task_id) == (ClusterSpec({}), None, None)


def test_validate_without_require_task_accepts_a_cluster_without_task():
    validate(ClusterSpec(W2), None, None, "SimpleClusterResolver", require_task=False)
    with pytest.raises(ValueError, match="^SimpleClusterResolver 'task' type None is unknown"):
        validate(ClusterSpec(W2), None, 0, "SimpleClusterResolver")


def test_ps_job_rejected_by_strategies_without_parameter_servers():
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    resolver = TFConfigClusterResolver(tf_config=_config(cluster, {"type": "worker", "index": 0}))
    with pytest.raises(
        ValueError,
        match=r"^MultiWorkerMirroredStrategy does not use parameter servers, but TF_CONFIG's cluster has a "
        r"'ps' job with 1 task\(s\): \['127.0.0.1:3'\]\. HINT: use ParameterServerStrategy, or remove 'ps'",
    ):
        validate_for_strategy(resolver, "MultiWorkerMirroredStrategy", allow_ps=False)
    with pytest.raises(ValueError, match="but the cluster has a 'ps' job"):
        validate_for_strategy(ClusterSpec(cluster), "MultiWorkerMirroredStrategy", allow_ps=False)
    validate_for_strategy(resolver, "ParameterServerStrategy", allow_ps=True)
    validate_for_strategy(SimpleClusterResolver(W2), "MultiWorkerMirroredStrategy", allow_ps=False)


@pytest.mark.parametrize(
    "address",
    ["localhost:1", "[::1]:2", "10.0.0.1:3", "ps-0.svc.cluster.local:4", "compose_service:5", "node01.:6"],
)
def test_valid_hosts_pass(address):
    validate(ClusterSpec({"worker": [address]}), "worker", 0)


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("a b:1", "is neither a DNS name"),
        ("-lead:1", "is neither a DNS name"),
        ("a..b:1", "is neither a DNS name"),
        ("host/x:1", "is neither a DNS name"),
        ("::1:2222", "is an IPv6 address without brackets"),
        ("[::g]:1", "is in brackets but is not an IPv6 address"),
        ("[host]:1", "is in brackets but is not an IPv6 address"),
    ],
)
def test_invalid_hosts_are_refused_with_the_task_and_a_hint(address, problem):
    with pytest.raises(
        ValueError, match=rf"^TF_CONFIG 'cluster' worker:0: the host .* {problem}.*\. Received: .* HINT: "
    ):
        validate(ClusterSpec({"worker": [address]}), "worker", 0)


@pytest.mark.parametrize(("first", "second"), [("A:1", "a:1"), ("[::1]:5", "[0::1]:5"), ("h.:1", "h:1")])
def test_two_spellings_of_one_address_are_one_address(first, second):
    with pytest.raises(
        ValueError, match=re.escape(f"gives '{first}' and '{second}', one address, to both worker:0 and")
    ):
        validate(ClusterSpec({"worker": [first, second]}), "worker", 0)


def test_resolution_names_both_tasks_that_share_an_address():
    spec = ClusterSpec({"chief": ["localhost:7"], "worker": ["127.0.0.1:7"], "evaluator": ["127.0.0.1:7"]})
    with pytest.raises(
        ValueError,
        match=r"^the cluster gives one address to two tasks once names are resolved: chief:0 and worker:0 "
        r"are both 127.0.0.1:7\. .* Received: 'localhost:7' and '127.0.0.1:7'\. HINT: change one of the",
    ):
        validate_resolved_addresses(spec)
    validate_resolved_addresses(ClusterSpec({"chief": ["localhost:7"], "worker": ["127.0.0.1:8"]}))


def test_only_the_task_that_must_serve_needs_a_name_that_resolves():
    spec = ClusterSpec({"worker": ["127.0.0.1:1", "not-up-yet.invalid:1"]})
    validate_resolved_addresses(spec)  # another machine's name may resolve later
    with pytest.raises(
        ValueError,
        match=r"^the cluster worker:1: cannot resolve host 'not-up-yet.invalid', and this task must serve "
        r"there \(the rendezvous\)\. Received: 'not-up-yet.invalid:1' \(.*\)\. HINT: ",
    ):
        validate_resolved_addresses(spec, serving=[("worker", 1)])


def test_resolve_host_gives_ip_addresses_and_names_itself_for_a_literal():
    assert resolve_host("127.0.0.1") == {"127.0.0.1"}
    assert resolve_host("[0::1]") == {"::1"}
    assert "127.0.0.1" in resolve_host("localhost")
    with pytest.raises(OSError, match="never resolves"):
        resolve_host("rank-1.torchrun.invalid")


def test_a_name_resolver_that_does_not_answer_is_given_up_on(monkeypatch):
    # A hung resolver cannot be produced on demand, so getaddrinfo is made to wait here.
    release = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: release.wait(30) and [])
    monkeypatch.setattr(_hosts, "RESOLVE_TIMEOUT_SECONDS", 0.2)
    try:
        with pytest.raises(TimeoutError, match=r"no answer from the name resolver within 0.2s"):
            resolve_host("slow.example")
        spec = ClusterSpec({"worker": ["slow.example:1", "127.0.0.1:2"]})
        with pytest.raises(ValueError, match=r"cannot resolve host 'slow.example'.*no answer from the name"):
            validate_resolved_addresses(spec, serving=[("worker", 0)])
    finally:
        release.set()
