"""The named strategy fixtures (a pytest plugin loaded by tests/conftest.py; docs/testing.md).

In-process strategies are fixtures that yield the strategy itself: ``default_strategy``,
``one_device``, ``mirrored_2cpu`` (two logical CPU replicas), ``central_storage_2cpu``;
``any_strategy`` is each of them in turn.

A multi-process strategy cannot be handed to the test process, so ``mwms_2workers`` (2 worker
processes under MultiWorkerMirroredStrategy) and ``ps_2workers_1ps`` (a chief process under
ParameterServerStrategy, 2 worker and 1 ps processes serving it) are runners: ``run(fn, *args)``
calls the module-level ``fn(strategy, *args)`` in every chief/worker task and returns each
task's (picklable) result. ``runner`` gives the same face to every named fixture, so one test
covers them all::

    def losses(strategy, steps):  # module level: the worker processes import it
        ...

    @pytest.mark.parametrize("runner", ["one_device", "mirrored_2cpu", "mwms_2workers"], indirect=True)
    def test_same_losses(runner):
        for result in runner.run(losses, 3):  # one result per process; in-process: one
            ...
"""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable, Iterator
from itertools import count
from pathlib import Path
from typing import Any

import pytest

import phalanx
from support.cluster import LocalCluster

__all__ = ["IN_PROCESS", "InProcessRunner", "ProcessRunner"]

IN_PROCESS: dict[str, Callable[[], phalanx.Strategy]] = {
    "one_device": lambda: phalanx.OneDeviceStrategy("cpu"),
    "mirrored_2cpu": lambda: phalanx.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage_2cpu": lambda: phalanx.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
RUN_FUNCTION = Path(__file__).with_name("run_function.py")


def _made(strategy: phalanx.Strategy) -> Iterator[phalanx.Strategy]:
    yield strategy
    if not strategy.is_default:
        strategy._threads.close()  # pytest holds fixture values past teardown: stop the replica threads


@pytest.fixture(params=["default", *IN_PROCESS])
def any_strategy(request):
    """Every in-process strategy and the default one, by name."""
    strategy = phalanx.get_strategy() if request.param == "default" else IN_PROCESS[request.param]()
    yield from _made(strategy)


@pytest.fixture
def default_strategy():
    """The default strategy (no ``scope()`` entered): one replica on this process's device."""
    return phalanx.get_strategy()


@pytest.fixture
def one_device():
    yield from _made(IN_PROCESS["one_device"]())


@pytest.fixture
def mirrored_2cpu():
    yield from _made(IN_PROCESS["mirrored_2cpu"]())


@pytest.fixture
def central_storage_2cpu():
    yield from _made(IN_PROCESS["central_storage_2cpu"]())


class InProcessRunner:
    """Runs ``fn(strategy, *args)`` here, on an in-process strategy: the runner face of its fixture."""

    def __init__(self, name: str, strategy: phalanx.Strategy) -> None:
        self.name = name
        self.strategy = strategy

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``[fn(strategy, *args)]``: one process, one result."""
        return [fn(self.strategy, *args)]


class ProcessRunner:
    """Runs a module-level ``fn(strategy, *args)`` in every chief/worker process of a local cluster.

    Each call starts a new cluster (free ports, `support.cluster.LocalCluster`); every process
    makes its strategy from its ``TF_CONFIG``, calls ``fn`` and sends back its result.

    Args:
        name: The fixture's name.
        strategy: ``"MultiWorkerMirroredStrategy"`` or ``"ParameterServerStrategy"`` (a
            ``phalanx`` class name).
        directory: Where the calls and results are exchanged.
        workers: Worker tasks.
        chief: A chief task.
        ps: Parameter-server tasks (the workers and ps then serve the chief).
    """

    def __init__(
        self, name: str, strategy: str, directory: Path, workers: int, chief: bool = False, ps: int = 0
    ) -> None:
        self.name = name
        self.strategy = strategy
        self.directory = directory
        self.cluster = {"workers": workers, "chief": chief, "ps": ps}
        self._calls = count()

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        strategy_kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> list[Any]:
        """Each chief/worker's ``fn(strategy, *args)``, in task order (chief first).

        Args:
            fn: A module-level function (the processes import its module by file).
            *args: Picklable arguments.
            strategy_kwargs: Passed to the strategy's constructor (e.g. ``devices``).
            env: Extra environment variables for every task.
            timeout: Seconds before every process is killed and the test fails naming the hung tasks.
        """
        folder = self.directory / f"call-{next(self._calls)}"
        folder.mkdir()
        call = {
            "module": fn.__module__,
            "file": inspect.getfile(fn),
            "qualname": fn.__qualname__,
            "args": args,
            "strategy": self.strategy,
            "strategy_kwargs": strategy_kwargs or {},
        }
        (folder / "call.pkl").write_bytes(pickle.dumps(call))
        with LocalCluster(env=env, **self.cluster) as cluster:
            cluster.start(RUN_FUNCTION, folder / "call.pkl").wait(timeout).check()
            return [pickle.loads((folder / f"{name}.pkl").read_bytes()) for name in cluster.trainers]


@pytest.fixture
def mwms_2workers(tmp_path_factory):
    """Two worker processes under MultiWorkerMirroredStrategy (one CPU replica each): a runner."""
    return ProcessRunner("mwms_2workers", "MultiWorkerMirroredStrategy", tmp_path_factory.mktemp("mwms"), 2)


@pytest.fixture
def fsdp_2workers(tmp_path_factory):
    """Two worker processes under FullyShardedStrategy (one CPU replica each): a runner."""
    directory = tmp_path_factory.mktemp("fsdp")
    return ProcessRunner("fsdp_2workers", "experimental.FullyShardedStrategy", directory, 2)


@pytest.fixture
def ps_2workers_1ps(tmp_path_factory):
    """A chief process under ParameterServerStrategy, served by 2 worker and 1 ps processes: a runner."""
    directory = tmp_path_factory.mktemp("ps")
    return ProcessRunner("ps_2workers_1ps", "ParameterServerStrategy", directory, 2, chief=True, ps=1)


@pytest.fixture
def runner(request):
    """The named strategy fixture ``request.param`` as a runner (parametrise with ``indirect=True``)."""
    value = request.getfixturevalue(request.param)
    in_process = request.param in IN_PROCESS or request.param == "default_strategy"
    return InProcessRunner(request.param, value) if in_process else value
