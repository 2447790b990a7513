"""ParameterServerStrategy scaling, phalanx against TensorFlow 2.21, with a plot.

Run: python benchmarks/bench_ps_scaling.py [--workloads mlp,emb] [--workers 1,2,4,8] [--ps 1,2]
     [--quick] [--plot ps_scaling.png] [--tf-python PATH]

Each point is one case of `bench_ps_tf.py` (same clusters, same timing, TF from its own
environment): steps/s and CPU ms per step summed over every task of the cluster. With more
tasks than cores (8 workers on a 2-core box) steps/s says how the cores were shared and CPU per
step is the comparable figure; the plot shows both, per workload and ps count. Set
``PHALANX_PS_DATA_PATH=grpc`` to see phalanx without its data path. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_ps_tf as side_by_side  # noqa: E402


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="mlp,emb")
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--ps", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tf-python", default=None)
    parser.add_argument("--plot", default=None, help="write the figure here (needs matplotlib)")
    return parser.parse_args()


def _cpu(result: dict[str, Any] | str | None) -> float | None:
    return sum(result["cpu_ms_per_step"].values()) if isinstance(result, dict) else None


def _rate(result: dict[str, Any] | str | None) -> float | None:
    return float(result["steps_per_s"]) if isinstance(result, dict) else None


def _plot(path: str, rows: list[tuple[str, int, int, Any, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(w, p) for w, _, p, _, _ in rows})
    fig, axes = plt.subplots(2, len(groups), figsize=(4 * len(groups), 7), squeeze=False)
    for column, (workload, ps) in enumerate(groups):
        mine = [(n, a, b) for w, n, p, a, b in rows if (w, p) == (workload, ps)]
        workers = [n for n, _, _ in mine]
        for row, (measure, label) in enumerate(((_rate, "steps/s"), (_cpu, "CPU ms per step"))):
            axis = axes[row][column]
            for index, side in ((1, "phalanx"), (2, "TensorFlow 2.21")):
                values = [measure(point[index]) for point in mine]
                shown = [(n, v) for n, v in zip(workers, values, strict=True) if v is not None]
                if shown:
                    axis.plot(*zip(*shown, strict=True), marker="o", label=side)
            axis.set_xscale("log", base=2)
            axis.set_xticks(workers, [str(n) for n in workers])
            axis.set_xlabel("workers")
            axis.set_ylabel(label)
            axis.set_title(f"{workload}, {ps} ps")
            axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = _parse()
    tf_python = side_by_side._tf_python(args)
    print(side_by_side._header(tf_python), flush=True)
    print(f"{'case':<28} {'steps/s ph':>10} {'TF':>8} {'ratio':>6} {'CPU ms ph':>10} {'CPU ms TF':>10}")
    rows = []
    for workload in args.workloads.split(","):
        for ps in (int(p) for p in args.ps.split(",")):
            for workers in (int(n) for n in args.workers.split(",")):
                case = (workload, workers, ps)
                ours = side_by_side._run_side(sys.executable, HERE / "bench_ps_tf.py", case, args)
                ref = (
                    side_by_side._run_side(tf_python, side_by_side.TF_REFERENCE, case, args)
                    if tf_python
                    else None
                )
                rows.append((workload, workers, ps, ours, ref))
                print(side_by_side._row(case, ours, ref), flush=True)
    if args.plot:
        _plot(args.plot, [(w, n, p, a, b) for w, n, p, a, b in rows])
        print(f"# plot: {args.plot}")


if __name__ == "__main__":
    main()
