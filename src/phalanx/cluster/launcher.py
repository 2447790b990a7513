"""``phalanx launch``: start a cluster's tasks as processes, each with its own ``TF_CONFIG``.

Local mode (`launch`) starts a whole cluster on 127.0.0.1 with free ports: an optional chief,
the workers and the parameter servers. Per-node mode (`launch_node`) starts the tasks of a
real cluster that live on this node; run it on every node.

Every task gets ``TF_CONFIG`` (the cluster and its own task); chief and worker tasks also get
torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (the chief's address), so torchrun scripts run unchanged. Every line a task
prints is shown prefixed with its name (``[worker-1] ...``), stdout to stdout and stderr to
stderr, as it is printed. When a task fails, the others are stopped (SIGTERM, then SIGKILL
after a grace period) and the exit code is the failed task's; in local mode, parameter servers
are stopped once every worker has finished; in a parameter-server cluster (a chief and ps
tasks), the worker and ps tasks are stopped once the chief has finished, in both modes, and
the exit code is the chief's. A ``timeout`` stops everything (exit code 124) and names the
tasks that were still running.

No task outlives the launcher: SIGINT, SIGTERM or SIGHUP to the launcher is passed on to the
tasks, which are killed if they have not exited within a grace period, and the launcher
exits with 128 + the signal's number; if the launcher is killed outright (SIGKILL), the
kernel kills its tasks (`phalanx.cluster._lifeline`).

Example::

    phalanx launch --workers 2 train.py --epochs 3
    phalanx launch --tf-config "$CLUSTER_JSON" --node "$(hostname)" train.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from phalanx import settings
from phalanx.cluster._ports import free_ports
from phalanx.cluster._processes import run_tasks
from phalanx.cluster._target import Target, build_command
from phalanx.cluster._tasks import (
    NodeTasks,
    PlannedTask,
    cluster_from,
    local_cluster,
    plan_tasks,
    select_node_tasks,
)
from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.elastic import ElasticLaunch
from phalanx.security.token import TOKEN_ENV, check_token, missing_token_error, new_token

__all__ = [
    "add_launch_arguments",
    "free_ports",
    "launch",
    "launch_node",
    "node_environments",
    "run_launch",
    "task_environments",
]

_JOB_ORDER = ("chief", "worker", "ps", "evaluator")


def launch(
    target: Target,
    *,
    workers: int | None = None,
    ps: int = 0,
    chief: bool = False,
    nproc_per_node: int | None = None,
    args: Sequence[Any] = (),
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    python: str = sys.executable,
    out: IO[str] | None = None,
    min_workers: int | None = None,
    max_restarts: int = 0,
    status: str | None = None,
) -> int:
    """Runs ``target`` once per task of a cluster on 127.0.0.1 and waits for it.

    Args:
        target: A script path; ``"module:function"`` (called with no arguments, ``sys.argv``
            holding ``args``); or a module-level function (called as ``function(*args)``
            in each task, pickled by reference, so it must be importable by name). A
            function's int result is the task's exit code.
        workers: Worker tasks (default 2, or as ``nproc_per_node`` implies).
        ps: Parameter-server tasks; stopped once every worker has finished.
        chief: Whether to add a ``chief`` task (rank 0, before the workers).
        nproc_per_node: torchrun's spelling: the chief + worker processes on this machine.
            ``workers = nproc_per_node - chief``; giving both must agree.
        args: Command-line arguments for every task (any picklable values for a function).
        env: Extra environment variables for every task.
        timeout: Seconds before every task is stopped (None: no limit).
        python: The interpreter for the tasks.
        out: One stream for all output (default: tasks' stdout/stderr to ours).
        min_workers: An elastic job (MultiWorkerMirroredStrategy): the workers that are left
            train on after losing one, down to this many (`phalanx.cluster.elastic`;
            docs/multi_worker.md, Elastic training). None: a lost worker ends the job.
        max_restarts: With ``min_workers``: how many times lost workers are started again
            (in all); a restarted worker joins the running job.
        status: ``HOST:PORT``: serve the job's status page there while it runs (from this
            process, so it outlives any task; docs/status_page.md). Loopback needs no token;
            another address needs ``PHALANX_CLUSTER_TOKEN`` given by the user.

    Returns:
        0 when every chief/worker task exited 0 (elastic: every one still in the job); else
        the failed task's exit code (negative when a signal killed it), 124 on timeout, or
        128 + N when this process received signal N (SIGINT, SIGTERM, SIGHUP; passed on to
        the tasks, which are then stopped).

    Raises:
        ValueError: Contradicting counts, a bad timeout, a target that cannot be run, or a
            ``PHALANX_CLUSTER_TOKEN`` too short to be a secret (without one, a fresh token
            is given to the tasks).
    """
    count = _worker_count(workers, nproc_per_node, chief)
    _check_elastic(min_workers, max_restarts, count + int(chief), ps)
    _check_timeout(timeout)
    argv = build_command(target, args, python)
    spec = local_cluster(count, ps, chief)
    # the tasks authenticate each other (ps transport, rendezvous store, TLS ring) with a
    # secret: the user's, or a fresh one
    token = _given_token(env)
    env = {**(env or {}), TOKEN_ENV: check_token(token) if token is not None else new_token()}
    tasks = plan_tasks(spec, _all_tasks(spec))
    page = _status_page(status, token, env[TOKEN_ENV], out)
    if page is None:
        return _run_local(argv, tasks, env, timeout, out, min_workers, max_restarts)
    try:
        env = {**env, **page.environment()}
        return _run_local(argv, tasks, env, timeout, out, min_workers, max_restarts, page.task_exited)
    finally:
        page.stop()


def _run_local(
    argv: list[str],
    tasks: Sequence[PlannedTask],
    env: dict[str, str],
    timeout: float | None,
    out: IO[str] | None,
    min_workers: int | None,
    max_restarts: int,
    on_exit: Callable[[str, int], None] | None = None,
) -> int:
    elastic = _elastic_launch(min_workers, max_restarts, env, out)
    if elastic is not None:
        env = {**elastic.environment(), **env}
    return run_tasks(argv, tasks, env, timeout, out, True, elastic, on_exit)


def _status_page(status: str | None, given: str | None, token: str, out: IO[str] | None) -> Any:
    """The launcher's status page (``--status``, a `LaunchedPage` serving already), or None."""
    if status is None:
        return None
    from phalanx.cluster._status_page import LaunchedPage  # phalanx.status imports this package

    page = LaunchedPage(status, token, user_given=given is not None)
    print(f"[launcher] status page at {page.url}", file=out if out is not None else sys.stderr, flush=True)
    return page


def _check_elastic(min_workers: int | None, max_restarts: int, trainers: int, ps: int) -> None:
    if min_workers is None:
        if max_restarts:
            raise ValueError(
                f"--max-restarts restarts lost workers of an elastic job, but no --min-workers was given. "
                f"Received: max_restarts={max_restarts}. HINT: add --min-workers M (M <= --workers)."
            )
        return
    if not 1 <= min_workers <= trainers or max_restarts < 0 or ps:
        raise ValueError(
            "An elastic job needs 1 <= --min-workers <= the workers, --max-restarts >= 0, and no ps tasks "
            f"(MultiWorkerMirroredStrategy only). Received: min_workers={min_workers}, workers={trainers}, "
            f"max_restarts={max_restarts}, ps={ps}. HINT: e.g. --workers 3 --min-workers 2."
        )


def _elastic_launch(
    min_workers: int | None, max_restarts: int, env: Mapping[str, str], out: IO[str] | None
) -> ElasticLaunch | None:
    """The elastic side of a local launch (it serves the store), or None."""
    if min_workers is None:
        return None
    stream = out if out is not None else sys.stderr

    def note(text: str) -> None:
        print(f"[launcher] {text}", file=stream, flush=True)

    return ElasticLaunch(min_workers, max_restarts, env[TOKEN_ENV], note)


def launch_node(
    target: Target,
    cluster: ClusterSpec | Mapping[str, Any] | str,
    *,
    node_tasks: NodeTasks = None,
    nproc_per_node: int | None = None,
    args: Sequence[Any] = (),
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    python: str = sys.executable,
    out: IO[str] | None = None,
) -> int:
    """Per-node mode for real clusters: starts this node's tasks, each with its ``TF_CONFIG``.

    Run it on every node with the same ``cluster``. Ranks are global (the chief, then workers);
    ``LOCAL_RANK`` counts this node's chief/worker tasks. Unlike `launch`, ps and evaluator
    tasks are not stopped when the workers finish (other nodes' workers may still need them):
    the call returns when every task of this node has exited, one fails, or ``timeout`` —
    or, in a parameter-server cluster whose chief runs on this node, when the chief has
    exited (its code is returned; this node's worker and ps tasks, which served it, are
    stopped). A cluster with ``ps`` tasks needs ``PHALANX_CLUSTER_TOKEN``, the same on every
    node.

    Args:
        target: As in `launch`.
        cluster: The whole cluster: a ClusterSpec, a dict, or JSON (a TF_CONFIG or its cluster).
        node_tasks: Which tasks run here: a host name (the tasks whose address has that host),
            ``[(job, index), ...]``, or None for this machine's host name.
        nproc_per_node: If given, must equal the number of chief/worker tasks selected.
        args, env, timeout, python, out: As in `launch`.

    Returns:
        As `launch`.

    Raises:
        ValueError: A malformed cluster, no task on this node, a contradicting
            ``nproc_per_node``, a bad timeout or target, or a cluster with ``ps`` tasks
            but no (or a too short) ``PHALANX_CLUSTER_TOKEN`` in ``env`` or the environment.
    """
    spec = cluster_from(cluster)
    if "ps" in spec.jobs:  # every node must present the same secret: only the user can give it
        token = _given_token(env)
        if token is None:
            raise missing_token_error()
        check_token(token)
    tasks = plan_tasks(spec, select_node_tasks(spec, node_tasks))
    trainers = sum(t.is_trainer for t in tasks)
    if nproc_per_node is not None and nproc_per_node != trainers:
        raise ValueError(
            f"--nproc-per-node ({nproc_per_node}) must equal the chief/worker tasks the cluster puts on this "
            f"node ({trainers}: {[t.name for t in tasks if t.is_trainer]}). HINT: drop --nproc-per-node; "
            "per-node mode takes the tasks from the cluster."
        )
    _check_timeout(timeout)
    argv = build_command(target, args, python)
    return run_tasks(argv, tasks, env, timeout, out, stop_auxiliary=False)


def task_environments(
    workers: int, ps: int = 0, chief: bool = False, host: str = "127.0.0.1"
) -> dict[str, dict[str, str]]:
    """The environment variables `launch` would give each task of a fresh local cluster.

    For starting the processes yourself (e.g. to kill one on purpose in a test).

    Returns:
        ``{"worker-0": {"TF_CONFIG": ..., "RANK": ...}, ...}``.

    Raises:
        ValueError: A negative count, or no chief and no worker.
    """
    spec = local_cluster(workers, ps, chief, host)
    return {t.name: t.env for t in plan_tasks(spec, _all_tasks(spec))}


def node_environments(
    cluster: ClusterSpec | Mapping[str, Any] | str, node_tasks: NodeTasks = None
) -> dict[str, dict[str, str]]:
    """The environment variables `launch_node` would give each of this node's tasks.

    Raises:
        ValueError: As `launch_node`.
    """
    spec = cluster_from(cluster)
    return {t.name: t.env for t in plan_tasks(spec, select_node_tasks(spec, node_tasks))}


def _given_token(env: Mapping[str, str] | None) -> str | None:
    token = (env or {}).get(TOKEN_ENV, settings.current().cluster_token or None)
    return token or None


def _all_tasks(spec: ClusterSpec) -> list[tuple[str, int]]:
    return [(job, i) for job in _JOB_ORDER if job in spec.jobs for i in spec.task_indices(job)]


def _worker_count(workers: int | None, nproc_per_node: int | None, chief: bool) -> int:
    if nproc_per_node is None:
        return 2 if workers is None else workers
    implied = nproc_per_node - int(chief)
    if nproc_per_node < 1 or (workers is not None and workers != implied):
        raise ValueError(
            "nproc_per_node counts the chief and worker processes on this machine (torchrun's meaning), "
            "so it must be >= 1 and equal workers + (1 if chief else 0). "
            f"Received: workers={workers}, chief={chief}, nproc_per_node={nproc_per_node}. "
            "HINT: pass only one of workers and nproc_per_node."
        )
    return implied


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None. Received: {timeout!r}.")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the arguments of ``phalanx launch`` to ``parser`` (run it with `run_launch`)."""
    local = parser.add_argument_group("local cluster (default): every task on 127.0.0.1")
    local.add_argument("--workers", type=int, default=None, help="worker tasks (default 2)")
    local.add_argument("--ps", type=int, default=None, help="parameter-server tasks (default 0)")
    local.add_argument("--chief", action="store_true", help="add a chief task (rank 0)")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="torchrun's name: chief + worker processes on this machine (must agree with --workers)",
    )
    node = parser.add_argument_group("per-node mode: this node's tasks of a real cluster")
    node.add_argument("--tf-config", default=None, help="the whole cluster: TF_CONFIG JSON, or its 'cluster'")
    node.add_argument("--node", default=None, help="this node's host name as the cluster spells it")
    node.add_argument(
        "--task", action="append", default=None, metavar="JOB:INDEX", help="a task to run here (repeatable)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="stop every task after this many seconds")
    elastic = parser.add_argument_group("elastic MultiWorkerMirrored (local mode): survive lost workers")
    elastic.add_argument(
        "--min-workers", type=int, default=None, help="train on after losing workers, down to this many"
    )
    elastic.add_argument(
        "--max-restarts", type=int, default=0, help="start lost workers again, this many times in all"
    )
    parser.add_argument(
        "--status",
        default=None,
        metavar="HOST:PORT",
        help="serve a live status page of the job there (127.0.0.1:PORT; another address needs "
        "PHALANX_CLUSTER_TOKEN)",
    )
    parser.add_argument("script", help="the training script, or module:function")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def run_launch(namespace: argparse.Namespace) -> int:
    """Runs ``phalanx launch`` from arguments parsed with `add_launch_arguments`.

    A usage error (contradicting options, a missing script) is printed as
    ``phalanx launch: error: ...`` and gives exit code 2, as argparse does.

    Returns:
        The launch's exit code.
    """
    try:
        return _run(namespace)
    except ValueError as exc:
        print(f"phalanx launch: error: {exc}", file=sys.stderr)
        return 2


def _run(ns: argparse.Namespace) -> int:
    get = ns.__dict__.get  # tolerate a namespace from a parser that lacks some options
    args, nproc, timeout = get("script_args") or [], get("nproc_per_node"), get("timeout")
    tf_config, node, tasks = get("tf_config"), get("node"), get("task")
    if tf_config is None:
        if node is not None or tasks:
            raise ValueError(
                "--node/--task choose this node's tasks of the --tf-config cluster, but no --tf-config "
                "was given. HINT: add --tf-config JSON, or drop --node/--task for a local cluster."
            )
        return launch(
            ns.script,
            workers=get("workers"),
            ps=get("ps") or 0,
            chief=bool(get("chief")),
            nproc_per_node=nproc,
            args=args,
            timeout=timeout,
            min_workers=get("min_workers"),
            max_restarts=get("max_restarts") or 0,
            status=get("status"),
        )
    if get("min_workers") is not None:
        raise ValueError(
            "--min-workers runs an elastic job in local mode only (the launcher serves its store). "
            "HINT: drop --tf-config, or run your own store and set PHALANX_MIN_WORKERS and "
            "PHALANX_ELASTIC_STORE on every task (docs/multi_worker.md)."
        )
    _check_per_node_flags(get("workers"), get("ps"), bool(get("chief")), node, tasks)
    node_tasks: NodeTasks = [_parse_task(t) for t in tasks] if tasks else node
    # per node, the chief serves the page (no launcher sees every task): the address is its
    from phalanx.status.settings import ADDRESS_ENV  # phalanx.status imports this package

    status = get("status")
    env = {ADDRESS_ENV: str(status)} if status else None
    return launch_node(
        ns.script, tf_config, node_tasks=node_tasks, nproc_per_node=nproc, args=args, timeout=timeout, env=env
    )


def _check_per_node_flags(
    workers: int | None, ps: int | None, chief: bool, node: str | None, tasks: list[str] | None
) -> None:
    flags = {"--workers": workers is not None, "--ps": ps is not None, "--chief": chief}
    local = [flag for flag, given in flags.items() if given]
    if local or (node is not None and tasks):
        raise ValueError(
            "With --tf-config the cluster comes from the JSON, and one of --node or --task picks this "
            f"node's tasks. Received also: {local or ['--node', '--task']}. HINT: drop them."
        )


def _parse_task(text: str) -> tuple[str, int]:
    job, _, index = text.partition(":")
    if not job or not index.isdigit():
        raise ValueError(f"--task must be JOB:INDEX, e.g. worker:0. Received: {text!r}.")
    return job, int(index)
