"""The `phalanx` command: `phalanx demo` and `phalanx launch`.

Building the parser imports neither torch nor any strategy (nor the launcher, unless the
command line says ``launch``): ``phalanx --help`` answers at once, and each subcommand
imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["DEMO_STRATEGIES", "main"]

# The names of phalanx.cli.demo.STRATEGIES, spelled here so that the parser needs no torch
# (tests/examples/test_demo.py checks that both lists agree).
DEMO_STRATEGIES = (
    "central_storage",
    "default",
    "mirrored",
    "multi_worker_mirrored",
    "one_device",
    "parameter_server",
)
DEFAULT_DEMO_STRATEGY = "mirrored"
# The demos that start their own local cluster (unless TF_CONFIG is set already).
_CLUSTER_DEMOS = {"multi_worker_mirrored", "parameter_server"}


def _demo(args: argparse.Namespace) -> int:
    import os

    if args.strategy in _CLUSTER_DEMOS and "TF_CONFIG" not in os.environ:
        return _launch_demo_cluster(args)
    from phalanx.cli.demo import run_demo

    accuracy = run_demo(args.strategy, epochs=args.epochs, batch_size=args.batch_size)
    return 0 if accuracy > 0 else 1


def _launch_demo_cluster(args: argparse.Namespace) -> int:
    from phalanx.cluster import launch

    task_args = [str(args.epochs), str(args.batch_size)]
    if args.strategy == "parameter_server":
        print(f"starting a chief, {args.workers} workers and 1 ps task on 127.0.0.1 (phalanx launch)")
        entry = "phalanx.cli.demo:parameter_server_task_main"
        return launch(entry, chief=True, workers=args.workers, ps=1, args=task_args)
    print(f"starting {args.workers} worker processes on 127.0.0.1 (phalanx launch)")
    return launch("phalanx.cli.demo:worker_main", workers=args.workers, args=task_args)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="train a small CNN on the 8x8 digits under a strategy",
        description="Trains a small CNN on scikit-learn's bundled 8x8 digits with Model.fit under a "
        "strategy and prints the test accuracy. The cluster strategies start their own local cluster.",
    )
    demo.add_argument(
        "--strategy",
        choices=DEMO_STRATEGIES,
        default=DEFAULT_DEMO_STRATEGY,
        help="which strategy to train under (default: %(default)s); multi_worker_mirrored starts "
        "--workers processes, parameter_server a chief, --workers workers and one ps task",
    )
    demo.add_argument(
        "--epochs", type=int, default=12, help="passes over the training digits (default: %(default)s)"
    )
    demo.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="global batch size, over all replicas (default: %(default)s)",
    )
    demo.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes for multi_worker_mirrored and parameter_server (default: %(default)s)",
    )
    demo.set_defaults(func=_demo)


def _add_launch(sub: argparse._SubParsersAction, with_arguments: bool) -> None:
    launch = sub.add_parser(
        "launch", help="start a local cluster: one process per task, each with its TF_CONFIG"
    )
    if with_arguments:  # the launcher's module is only imported when `launch` is on the line
        from phalanx.cluster.launcher import add_launch_arguments, run_launch

        add_launch_arguments(launch)
        launch.set_defaults(func=run_launch)


def _parser(with_launch_arguments: bool = True) -> argparse.ArgumentParser:
    """The command's parser; without the launch arguments it imports nothing beyond argparse."""
    parser = argparse.ArgumentParser(prog="phalanx", description="tf.distribute's strategies for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_launch(sub, with_launch_arguments)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``phalanx`` command."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = _parser(with_launch_arguments="launch" in arguments).parse_args(arguments)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
