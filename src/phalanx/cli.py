"""The `phalanx` command: `phalanx demo` and `phalanx launch`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import os

    from phalanx.demo import run_demo

    if args.strategy == "multi_worker_mirrored" and "TF_CONFIG" not in os.environ:
        from phalanx.cluster import launch

        print(f"starting {args.workers} worker processes on 127.0.0.1 (phalanx launch)")
        return launch(
            "phalanx.demo:worker_main", workers=args.workers, args=[str(args.epochs), str(args.batch_size)]
        )
    accuracy = run_demo(args.strategy, epochs=args.epochs, batch_size=args.batch_size)
    return 0 if accuracy > 0 else 1


def _parser() -> argparse.ArgumentParser:
    from phalanx.demo import STRATEGIES, default_strategy_name

    parser = argparse.ArgumentParser(prog="phalanx", description="tf.distribute's strategies for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small CNN on the 8x8 digits under a strategy")
    demo.add_argument(
        "--strategy",
        choices=sorted(STRATEGIES),
        default=default_strategy_name(),
        help="which strategy to train under (default: %(default)s)",
    )
    demo.add_argument("--epochs", type=int, default=12)
    demo.add_argument("--batch-size", type=int, default=64, help="global batch size")
    demo.add_argument("--workers", type=int, default=2, help="processes for multi_worker_mirrored")
    demo.set_defaults(func=_demo)
    from phalanx.cluster.launcher import add_launch_arguments, run_launch

    launch = sub.add_parser(
        "launch", help="start a local cluster: one process per task, each with its TF_CONFIG"
    )
    add_launch_arguments(launch)
    launch.set_defaults(func=run_launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``phalanx`` command."""
    args = _parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
