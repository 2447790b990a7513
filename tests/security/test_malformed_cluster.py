"""The catalogue of malformed clusters: each is rejected at once, naming the field, and nothing runs.

Every malformed ``TF_CONFIG`` of the resolvers' tests, plus: a host with a space,
one address spelled two ways, two names that resolve to one address, a chief host that does
not resolve, a cluster token too short to be a secret. The first kind fails when the resolver
is created (no network); names are resolved when a strategy starts, before it opens its
rendezvous store, so those cases prove that nothing listens afterwards.
"""

from __future__ import annotations

import io
import json

import pytest

import phalanx
from phalanx.cluster import TFConfigClusterResolver, launch
from phalanx.cluster._ports import free_ports
from phalanx.security.token import TOKEN_ENV, cluster_token
from security.helpers import SCRIPTS, port_is_free

W2 = {"worker": ["a:1", "a:2"]}


def _config(cluster=None, task=None, **extra):
    config = {"cluster": cluster if cluster is not None else W2, **extra}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


CATALOGUE = [
    # (id, TF_CONFIG, regex the message must match): from the resolvers' own tests
    (
        "malformed-json",
        '{"cluster": {"worker": ["a:1"]},}',
        r"not valid JSON: Expecting property name .* at line 1 column 33 \(char 32\)",
    ),
    (
        "malformed-json-caret",
        '{\n  "cluster": [}',
        r'line 2 column 15 \(char 16\):\n {6}"cluster": \[}\n {18}\^\n',
    ),  # the caret sits under the error
    ("not-an-object", '["a:1"]', r"must be a JSON object .* Received: '\[\"a:1\"\]' \(a JSON list\)"),
    (
        "no-cluster",
        '{"task": {"type": "worker", "index": 0}}',
        r"has no 'cluster' field. Received keys: \['task'\]",
    ),
    ("cluster-not-object", '{"cluster": ["a:1"]}', r"'cluster' must be an object of job name -> list"),
    (
        "cluster-bad-entry",
        _config({"worker": [5]}),
        r"'cluster' is invalid: cluster\['worker'\]\[0\] must be",
    ),
    ("no-task-for-two", _config(), r"'cluster' has 2 tasks but no 'task' says which one this process is"),
    ("task-not-object", _config(task="worker"), r"'task' must be an object with 'type' and 'index'"),
    ("task-no-type", _config(task={"index": 0}), r"'task' has no 'type'"),
    ("task-no-index", _config(task={"type": "worker"}), r"'task' has no 'index'"),
    (
        "task-type-not-str",
        _config(task={"type": 1, "index": 0}),
        r"'task' type must be a string. Received: 1",
    ),
    (
        "unknown-task-type",
        _config(task={"type": "boss", "index": 0}),
        r"'task' type 'boss' is unknown. Allowed types: chief, worker, ps, evaluator",
    ),
    (
        "unknown-job",
        _config({"master": ["a:1"]}, {"type": "chief", "index": 0}),
        r"unknown job 'master'. Allowed jobs: chief, worker, ps, evaluator. .*'master' is now 'chief'",
    ),
    (
        "task-type-not-in-cluster",
        _config(task={"type": "chief", "index": 0}),
        r"'task' type 'chief' is not a job of the 'cluster' \(its jobs: \['worker'\]\)",
    ),
    (
        "index-out-of-range",
        _config(task={"type": "worker", "index": 2}),
        r"'task' index 2 is out of range: job 'worker' has 2 task\(s\), with indices \[0, 1\]",
    ),
    ("negative-index", _config(task={"type": "worker", "index": -1}), r"non-negative integer. Received: -1"),
    ("string-index", _config(task={"type": "worker", "index": "1"}), r"non-negative integer. Received: '1'"),
    ("bool-index", _config(task={"type": "worker", "index": True}), r"non-negative integer. Received: True"),
    (
        "duplicate-address",
        _config({"worker": ["a:1"], "ps": ["a:1"]}, {"type": "worker", "index": 0}),
        r"gives the address 'a:1' to both ps:0 and worker:0",
    ),
    (
        "two-chiefs",
        _config({"chief": ["a:1", "a:2"]}, {"type": "chief", "index": 0}),
        r"has 2 'chief' tasks; at most one chief is allowed. Received: \['a:1', 'a:2'\]",
    ),
    (
        "two-evaluators",
        _config({"worker": ["a:1"], "evaluator": ["a:2", "a:3"]}, {"type": "worker", "index": 0}),
        r"has 2 'evaluator' tasks; at most one evaluator",
    ),
    (
        "empty-job",
        _config({"worker": ["a:1"], "ps": []}, {"type": "worker", "index": 0}),
        r"job 'ps' has no tasks",
    ),
    (
        "address-without-port",
        _config({"worker": ["a"]}, {"type": "worker", "index": 0}),
        r"'cluster' worker:0: A task address must be 'host:port' .* Received: 'a'",
    ),
    (
        "port-out-of-range",
        _config({"worker": ["a:70000"]}, {"type": "worker", "index": 0}),
        r"port in 0..65535. Received: 'a:70000'",
    ),
    (
        "rpc-layer-not-str",
        _config(task={"type": "worker", "index": 0}, rpc_layer=3),
        r"'rpc_layer' must be a string",
    ),
    # ClusterSpec's rules, reached through TF_CONFIG
    (
        "job-name-not-identifier",
        _config({"Worker-1": ["a:1"]}),
        r"'cluster' is invalid: Job names must be identifiers",
    ),
    ("empty-address", _config({"worker": [""]}), r"cluster\['worker'\]\[0\] must be a non-empty 'host:port'"),
    ("job-not-a-list", _config({"worker": "a:1"}), r"cluster\['worker'\] must be a list .* Received: 'a:1'"),
    ("index-not-a-number", _config({"worker": {"x": "a:1"}}), r"task indices must be non-negative integers"),
    # host syntax, and one address spelled two ways
    (
        "space-in-host",
        _config({"worker": ["a b:1", "a:2"]}, {"type": "worker", "index": 1}),
        r"'cluster' worker:0: the host 'a b' is neither a DNS name .* Received: 'a b:1'\. HINT: ",
    ),
    (
        "ipv6-without-brackets",
        _config({"worker": ["::1:2222"]}, {"type": "worker", "index": 0}),
        r"'cluster' worker:0: the host '::1' is an IPv6 address without brackets .* HINT: .*'\[::1\]:2222'",
    ),
    (
        "bad-ipv6-in-brackets",
        _config({"worker": ["[::zz]:1"]}, {"type": "worker", "index": 0}),
        r"the host '\[::zz\]' is in brackets but is not an IPv6 address",
    ),
    (
        "one-address-two-spellings",
        _config({"worker": ["Node-A:1", "node-a.:1"]}, {"type": "worker", "index": 0}),
        r"gives 'Node-A:1' and 'node-a.:1', one address, to both worker:0 and worker:1",
    ),
]


@pytest.mark.parametrize(("tf_config", "message"), [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_a_malformed_tf_config_is_rejected_when_the_resolver_is_created(monkeypatch, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ValueError, match=message) as raised:
        TFConfigClusterResolver()
    assert str(raised.value).startswith("TF_CONFIG")


def _resolved_cases():
    chief, worker = free_ports(2)
    return [
        (
            "duplicate-after-resolution",
            {"worker": [f"localhost:{chief}", f"127.0.0.1:{chief}"]},
            rf"^TF_CONFIG's cluster gives one address to two tasks once names are resolved: worker:0 and "
            rf"worker:1 are both 127.0.0.1:{chief}\. .* Received: 'localhost:{chief}' and '127.0.0.1:",
        ),
        (
            "unresolvable-chief-host",
            {"chief": [f"no-such-host.phalanx.invalid:{chief}"], "worker": [f"127.0.0.1:{worker}"]},
            r"^TF_CONFIG's cluster chief:0: cannot resolve host 'no-such-host.phalanx.invalid', and this "
            r"task must serve there \(the rendezvous\)\. Received: .* HINT: ",
        ),
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", range(2), ids=["duplicate-after-resolution", "unresolvable-chief-host"])
def test_names_are_resolved_before_the_rendezvous_store_opens(case):
    _, cluster, message = _resolved_cases()[case]
    chief_job = "chief" if "chief" in cluster else "worker"
    resolver = TFConfigClusterResolver(tf_config=_config(cluster, {"type": chief_job, "index": 0}))
    with pytest.raises(ValueError, match=message):
        phalanx.MultiWorkerMirroredStrategy(resolver, join_timeout=600)  # rejected at once, not after 600s
    ports = [int(a.rsplit(":", 1)[1]) for tasks in cluster.values() for a in tasks]
    assert all(port_is_free(p) for p in ports)  # no store was opened


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("abc12", r"must be at least 16 characters: .* Received: a token of 5 characters\. HINT: "),
        ("x" * 15, r"must be at least 16 characters"),
        ("sixteen-chars-é!", r"must be printable ASCII"),
    ],
)
def test_a_token_too_weak_to_be_a_secret_is_refused_and_no_server_listens(monkeypatch, token, message):
    monkeypatch.setenv(TOKEN_ENV, token)
    with pytest.raises(ValueError, match=f"^PHALANX_CLUSTER_TOKEN {message}") as raised:
        cluster_token()
    assert token not in str(raised.value)  # the secret itself is never shown
    (port,) = free_ports(1)
    with pytest.raises(ValueError, match=message):
        phalanx.Server({"ps": [f"127.0.0.1:{port}"]}, job_name="ps", task_index=0)
    assert port_is_free(port)
    out = io.StringIO()
    with pytest.raises(ValueError, match=message):
        launch(SCRIPTS / "ps_cluster_task.py", workers=1, ps=1, out=out, timeout=30)
    assert out.getvalue() == ""  # no task started


def test_the_token_error_says_what_per_node_mode_needs(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match="PHALANX_CLUSTER_TOKEN is not set") as raised:
        cluster_token()
    text = str(raised.value)
    assert "`phalanx launch` sets one by itself for a local cluster" in text
    assert "needs the same secret on every node" in text
    assert "secrets.token_hex(16)" in text
    assert "phalanx launch sets one" not in text  # the old, wrong hint
