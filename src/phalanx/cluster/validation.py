"""Checks of a cluster configuration, with messages that name the offending field.

The resolvers call `validate` when they are created, so a bad ``TF_CONFIG`` fails at start
with a message saying which field is wrong, what was received and how to fix it, rather than
as a hang at the first collective. These checks need no network. Strategies call
`validate_for_strategy` before they contact anyone: it also resolves the tasks' host names,
so that a name that does not resolve, or two addresses that turn out to be one, are
reported as such before a rendezvous store is opened.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phalanx.cluster._hosts import canonical_host, host_syntax_error, resolve_host
from phalanx.cluster._roles import TASK_TYPES, split_address, trainer_tasks
from phalanx.cluster.cluster_spec import ClusterSpec

if TYPE_CHECKING:
    from phalanx.cluster.resolvers.cluster_resolver import ClusterResolver

__all__ = [
    "TASK_TYPES",
    "TFConfig",
    "parse_tf_config",
    "validate",
    "validate_cluster",
    "validate_for_strategy",
    "validate_resolved_addresses",
    "validate_task",
]

_ALLOWED = ", ".join(TASK_TYPES)
_EXAMPLE = '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}}'
_SINGLETON_JOBS = ("chief", "evaluator")  # TF allows at most one task in each


@dataclass(frozen=True)
class TFConfig:
    """The fields of a ``TF_CONFIG`` (structure checked, cluster rules not yet)."""

    cluster: ClusterSpec
    task_type: str | None
    task_id: int | None
    rpc_layer: str | None
    environment: str


def parse_tf_config(text: str, source: str = "TF_CONFIG") -> TFConfig:
    """Parses ``TF_CONFIG`` JSON into its fields.

    An empty or blank text is an empty config (a single process, as TF reads it).

    Args:
        text: The JSON text.
        source: Where the text came from, for messages.

    Raises:
        ValueError: Malformed JSON (the message shows the line, column and a caret), not an
            object, no ``cluster``, or a ``cluster``/``task``/``rpc_layer``/``environment``
            field of the wrong shape.
    """
    if not text.strip():
        return TFConfig(ClusterSpec({}), None, None, None, "")
    config = _load_json(text, source)
    if "cluster" not in config:
        raise ValueError(
            f"{source} has no 'cluster' field. Received keys: {sorted(config)}. HINT: {source}='{_EXAMPLE}'."
        )
    task_type, task_id = _parse_task(config.get("task", {}), source)
    return TFConfig(
        cluster=_parse_cluster(config["cluster"], source),
        task_type=task_type,
        task_id=task_id,
        rpc_layer=_optional_string(config, "rpc_layer", source),
        environment=_optional_string(config, "environment", source) or "",
    )


def _load_json(text: str, source: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        line = text.splitlines()[exc.lineno - 1] if text.splitlines() else ""
        raise ValueError(
            f"{source} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
            f"(char {exc.pos}):\n    {line}\n    {' ' * (exc.colno - 1)}^\n"
            f"HINT: {source} must be one JSON object, e.g. {_EXAMPLE}."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{source} must be a JSON object with 'cluster' and 'task' fields. "
            f"Received: {text!r} (a JSON {type(config).__name__}). HINT: {_EXAMPLE}."
        )
    return config


def _parse_cluster(cluster: Any, source: str) -> ClusterSpec:
    if not isinstance(cluster, dict):
        raise ValueError(
            f"{source} 'cluster' must be an object of job name -> list of 'host:port'. "
            f'Received: {cluster!r}. HINT: "cluster": {{"worker": ["host1:2222", "host2:2222"]}}.'
        )
    try:
        return ClusterSpec(cluster)
    except ValueError as exc:
        raise ValueError(f"{source} 'cluster' is invalid: {exc}") from None


def _parse_task(task: Any, source: str) -> tuple[str | None, int | None]:
    if not isinstance(task, dict):
        raise ValueError(
            f"{source} 'task' must be an object with 'type' and 'index'. Received: {task!r}. "
            'HINT: "task": {"type": "worker", "index": 0}.'
        )
    if not task:
        return None, None
    for key in ("type", "index"):
        if key not in task:
            raise ValueError(
                f"{source} 'task' has no {key!r}. Received: {task!r}. "
                'HINT: "task": {"type": "worker", "index": 0}.'
            )
    if not isinstance(task["type"], str):
        raise ValueError(f"{source} 'task' type must be a string. Received: {task['type']!r}.")
    return task["type"], task["index"]


def _optional_string(config: dict[str, Any], key: str, source: str) -> str | None:
    value = config.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{source} {key!r} must be a string. Received: {value!r}.")
    return value


def validate(
    cluster: ClusterSpec,
    task_type: str | None,
    task_id: object,
    source: str = "TF_CONFIG",
    require_task: bool = True,
) -> None:
    """Checks a cluster and this process's task in it; the resolvers call this at creation.

    Args:
        cluster: The cluster.
        task_type: This process's job, or None when not given.
        task_id: This process's index in its job, or None.
        source: Where the configuration came from, for messages.
        require_task: Whether a cluster of several tasks must say which task this is.

    Raises:
        ValueError: The first rule broken, naming the field (see `validate_cluster` and
            `validate_task`), or no task given for a cluster of several tasks.
    """
    validate_cluster(cluster, source)
    if task_type is None and task_id is None:
        total = sum(cluster.num_tasks(job) for job in cluster.jobs)
        if require_task and total > 1:
            raise ValueError(
                f"{source} 'cluster' has {total} tasks but no 'task' says which one this process is. "
                'HINT: add "task": {"type": "worker", "index": 0}, with a different task in every process.'
            )
        return
    validate_task(cluster, task_type, task_id, source)


def validate_cluster(cluster: ClusterSpec, source: str = "TF_CONFIG") -> None:
    """Checks job names, empty jobs, the chief and evaluator counts, and the addresses.

    Raises:
        ValueError: An unknown job (the allowed are chief, worker, ps, evaluator), a job with no
            tasks, more than one chief or evaluator, an address that is not ``host:port``, or
            one address given to two tasks.
    """
    for job in cluster.jobs:
        _check_job(cluster, job, source)
    _check_addresses(cluster, source)


def _check_job(cluster: ClusterSpec, job: str, source: str) -> None:
    if job not in TASK_TYPES:
        raise ValueError(
            f"{source} 'cluster' has an unknown job {job!r}. Allowed jobs: {_ALLOWED}. "
            f"HINT: rename {job!r} to one of them (TF1's 'master' is now 'chief')."
        )
    count = cluster.num_tasks(job)
    if count == 0:
        raise ValueError(
            f"{source} 'cluster' job {job!r} has no tasks. HINT: list its 'host:port' addresses, "
            "or remove the job."
        )
    if job in _SINGLETON_JOBS and count > 1:
        raise ValueError(
            f"{source} 'cluster' has {count} {job!r} tasks; at most one {job} is allowed. "
            f"Received: {cluster.as_dict()[job]!r}. HINT: keep one and make the others workers."
        )


def _check_addresses(cluster: ClusterSpec, source: str) -> None:
    seen: dict[tuple[str, int], tuple[str, str]] = {}
    for job, index, address in _tasks(cluster):
        try:
            host, port = split_address(address)
        except ValueError as exc:
            raise ValueError(f"{source} 'cluster' {job}:{index}: {exc}") from None
        problem = host_syntax_error(host)
        if problem is not None:
            raise ValueError(
                f"{source} 'cluster' {job}:{index}: the host {host!r} {problem}. Received: {address!r}. "
                "HINT: a host is a DNS name ('worker-0.example.com'), an IPv4 address ('10.0.0.1') or an "
                "IPv6 address in brackets ('[::1]:2222')."
            )
        key = (canonical_host(host), port)
        if key in seen:
            other, spelled = seen[key]
            same = (
                f"the address {address!r}"
                if spelled == address
                else f"{spelled!r} and {address!r}, one address,"
            )
            raise ValueError(
                f"{source} 'cluster' gives {same} to both {other} and {job}:{index}. Every task needs its "
                "own host:port. HINT: change one of the ports."
            )
        seen[key] = (f"{job}:{index}", address)


def _tasks(cluster: ClusterSpec) -> list[tuple[str, int, str]]:
    return [(job, i, cluster.task_address(job, i)) for job in cluster.jobs for i in cluster.task_indices(job)]


def validate_task(
    cluster: ClusterSpec, task_type: str | None, task_id: object, source: str = "TF_CONFIG"
) -> None:
    """Checks that ``task_type:task_id`` is a task of the cluster.

    An ``evaluator`` need not be listed in the cluster (TF's rule: it runs on its own).

    Raises:
        ValueError: An unknown or missing type, a type that is not a job of the cluster, an
            index that is not a non-negative integer, or an index past the job's size.
    """
    if task_type not in TASK_TYPES:
        raise ValueError(
            f"{source} 'task' type {task_type!r} is unknown. Allowed types: {_ALLOWED}. "
            'HINT: "task": {"type": "worker", "index": 0}.'
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        raise ValueError(
            f"{source} 'task' index must be a non-negative integer. Received: {task_id!r}. "
            "HINT: indices count from 0 within each job."
        )
    if task_type not in cluster.jobs:
        if task_type == "evaluator":
            return
        raise ValueError(
            f"{source} 'task' type {task_type!r} is not a job of the 'cluster' (its jobs: {cluster.jobs}). "
            f"HINT: add a {task_type!r} job to the cluster, or fix the task type."
        )
    if task_id not in cluster.task_indices(task_type):
        raise ValueError(
            f"{source} 'task' index {task_id} is out of range: job {task_type!r} has "
            f"{cluster.num_tasks(task_type)} task(s), with indices {cluster.task_indices(task_type)}. "
            "HINT: indices count from 0."
        )


def validate_for_strategy(
    resolver: ClusterResolver | ClusterSpec, strategy_name: str, allow_ps: bool
) -> None:
    """Rejects cluster jobs that a strategy cannot use.

    Args:
        resolver: The strategy's cluster resolver (or its ClusterSpec).
        strategy_name: The strategy's class name, for the message.
        allow_ps: Whether the strategy uses parameter servers.

    Raises:
        ValueError: A ``ps`` job given to a strategy without parameter servers; with several
            chief/worker tasks, an address `validate_resolved_addresses` refuses (resolving
            names, so this may wait for the name resolver, at most
            ``RESOLVE_TIMEOUT_SECONDS`` per name).
    """
    task: tuple[str | None, int | None] | None = None
    if isinstance(resolver, ClusterSpec):
        spec, where = resolver, "the cluster"
    else:
        spec, where = resolver.cluster_spec(), f"{resolver.source}'s cluster"
        task = (resolver.task_type, resolver.task_id)
    if not allow_ps and "ps" in spec.jobs:
        raise ValueError(
            f"{strategy_name} does not use parameter servers, but {where} has a 'ps' job "
            f"with {spec.num_tasks('ps')} task(s): {spec.as_dict()['ps']!r}. "
            "HINT: use ParameterServerStrategy, or remove 'ps' from the cluster."
        )
    trainers = trainer_tasks(spec)
    if len(trainers) > 1:  # a rendezvous: names are about to be dialled and served
        # The chief (rank 0) serves the rendezvous at its address: its own name must resolve.
        validate_resolved_addresses(spec, where, serving=[trainers[0]] if task == trainers[0] else [])


def validate_resolved_addresses(
    cluster: ClusterSpec, where: str = "the cluster", serving: Sequence[tuple[str, int]] = ()
) -> None:
    """Resolves the tasks' host names: the tasks this process serves must resolve, and no two
    tasks may share an IP address and port once names are resolved (``localhost:2222`` beside
    ``127.0.0.1:2222``). A name that does not resolve for another task is left alone here (it
    may resolve later, once that task's machine is up).

    Args:
        cluster: The cluster.
        where: The cluster's name in messages ("TF_CONFIG's cluster").
        serving: The tasks this process will listen at (the chief serves the rendezvous).

    Raises:
        ValueError: A served task's host does not resolve ("cannot resolve host ..."), or two
            tasks resolve to one address (both are named).
    """
    owners: dict[tuple[str, int], tuple[str, str]] = {}
    resolved: dict[str, set[str] | OSError] = {}  # each name is looked up once
    for job, index, address in _tasks(cluster):
        if job == "evaluator":
            continue  # it serves nothing and runs on its own
        host, port = split_address(address)
        if host not in resolved:
            resolved[host] = _resolve(host)
        ips = resolved[host]
        if isinstance(ips, OSError):
            if (job, index) in serving:
                raise ValueError(
                    f"{where} {job}:{index}: cannot resolve host {host!r}, and this task must serve there "
                    f"(the rendezvous). Received: {address!r} ({ips}). HINT: fix the host name in the "
                    "cluster spec, or use this machine's name or IP address (`hostname -f`); on Kubernetes, "
                    "check that the task's service exists."
                )
            continue  # another machine's name: it may resolve once that machine is up
        for ip in sorted(ips):
            _claim(owners, (ip, port), (f"{job}:{index}", address), where)


def _claim(
    owners: dict[tuple[str, int], tuple[str, str]], slot: tuple[str, int], task: tuple[str, str], where: str
) -> None:
    other = owners.setdefault(slot, task)
    if other[0] != task[0]:
        raise ValueError(
            f"{where} gives one address to two tasks once names are resolved: {other[0]} and {task[0]} are "
            f"both {slot[0]}:{slot[1]}. Every task needs its own host:port. Received: {other[1]!r} and "
            f"{task[1]!r}. HINT: change one of the ports."
        )


def _resolve(host: str) -> set[str] | OSError:
    try:
        return resolve_host(host)
    except OSError as exc:
        return exc
