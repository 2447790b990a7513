"""The process side of `support.strategies.ProcessRunner`: ``python run_function.py CALL_FILE``.

Reads the call from CALL_FILE (the function's module file and name, its arguments, the
strategy class and its keyword arguments), makes the strategy from this task's ``TF_CONFIG``,
runs the function and pickles its result to ``<task>.pkl`` beside CALL_FILE (``worker-0.pkl``).
In a parameter-server cluster the worker and ps tasks serve the chief instead.
"""

import importlib
import importlib.util
import pickle
import sys
from pathlib import Path
from typing import Any

import phalanx


def _function(module_name: str, file: str, qualname: str):
    """The function, from its module as the test process knows it (a test module, a script)."""
    try:
        module = importlib.import_module(module_name)
        if Path(module.__file__).resolve() != Path(file).resolve():
            raise ImportError(f"{module_name} is another module here")
    except ImportError:  # a test module that pytest imported by its path
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # results pickled by reference to it load in the test
        spec.loader.exec_module(module)
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def main(call_file: Path) -> None:
    call = pickle.loads(call_file.read_bytes())
    resolver = phalanx.cluster.TFConfigClusterResolver()
    name = f"{resolver.task_type}-{resolver.task_id}"
    # every task imports the function's module, as every task of a real program runs its script:
    # a function it schedules on a parameter-server worker is pickled by reference to it
    function = _function(call["module"], call["file"], call["qualname"])
    if call["strategy"] == "ParameterServerStrategy" and resolver.task_type in ("worker", "ps"):
        job, index = resolver.task_type, resolver.task_id
        phalanx.Server(resolver.cluster_spec(), job_name=job, task_index=index).join()
        return
    strategy_class: Any = phalanx
    for part in call["strategy"].split("."):  # "experimental.FullyShardedStrategy" too
        strategy_class = getattr(strategy_class, part)
    strategy = strategy_class(**call["strategy_kwargs"])
    try:
        result = function(strategy, *call["args"])
        (call_file.parent / f"{name}.pkl").write_bytes(pickle.dumps(result))
    finally:
        strategy.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
