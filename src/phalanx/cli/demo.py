"""`phalanx demo`: a small CNN on scikit-learn's 8x8 digits, trained with Model.fit under any strategy.

Nothing is downloaded: the digits ship inside scikit-learn.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "STRATEGIES",
    "build_strategy",
    "default_strategy_name",
    "parameter_server_task_main",
    "run_demo",
    "worker_main",
]


def _mirrored() -> Any:
    from phalanx import MirroredStrategy

    if torch.cuda.is_available():
        return MirroredStrategy()
    return MirroredStrategy([f"cpu:{i}" for i in range(max(2, min(4, os.cpu_count() or 2)))])


def _multi_worker() -> Any:
    from phalanx import MultiWorkerMirroredStrategy

    return MultiWorkerMirroredStrategy()


def _parameter_server() -> Any:
    from phalanx import ParameterServerStrategy
    from phalanx.cluster.resolvers import TFConfigClusterResolver

    return ParameterServerStrategy(TFConfigClusterResolver())


STRATEGIES: dict[str, Callable[[], Any]] = {
    "default": lambda: __import__("phalanx").get_strategy(),
    "one_device": lambda: __import__("phalanx").OneDeviceStrategy(
        "cuda:0" if torch.cuda.is_available() else "cpu"
    ),
    "mirrored": _mirrored,
    "multi_worker_mirrored": _multi_worker,
    "central_storage": lambda: __import__("phalanx").CentralStorageStrategy(
        None if torch.cuda.is_available() else ["cpu:0", "cpu:1"]
    ),
    "parameter_server": _parameter_server,
}


def default_strategy_name() -> str:
    """The strongest strategy this machine runs in one process: replicas on every GPU or core."""
    return "mirrored"


def build_strategy(name: str) -> Any:
    """Creates a strategy by its demo name.

    Raises:
        ValueError: Unknown name.
    """
    if name not in STRATEGIES:
        raise ValueError(f"Unknown strategy {name!r}. Choose one of {sorted(STRATEGIES)}.")
    return STRATEGIES[name]()


class DigitsCNN(nn.Module):
    """Conv(16) → pool → Conv(32) → pool → Dense(64) → Dropout → Dense(10) logits for 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as float32 [N, 1, 8, 8] in [0, 1] and int64 labels, split 80 / 20 with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def run_demo(
    strategy_name: str | None = None, epochs: int = 12, batch_size: int = 64, verbose: int = 1
) -> float:
    """Trains the digits CNN under a strategy and returns the test accuracy (prints on the chief)."""
    import phalanx

    torch.manual_seed(0)
    strategy = build_strategy(strategy_name or default_strategy_name())
    x_train, y_train, x_test, y_test = load_digits_split()
    with strategy.scope():
        model = phalanx.Model(DigitsCNN())
        model.compile(
            optimizer="adam",
            loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    if strategy.is_chief and verbose:
        print(
            f"phalanx demo: {strategy!r}, {strategy.num_replicas_in_sync} replica(s), "
            f"global batch {batch_size}, {len(x_train)} training digits"
        )
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=verbose)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    if strategy.is_chief and verbose:
        print(f"test accuracy: {accuracy:.4f}")
    return float(accuracy)


def worker_main() -> int:
    """One worker of ``phalanx demo --strategy multi_worker_mirrored`` (started by the launcher)."""
    import sys

    epochs, batch_size = int(sys.argv[1]), int(sys.argv[2])
    accuracy = run_demo("multi_worker_mirrored", epochs=epochs, batch_size=batch_size)
    return 0 if accuracy > 0 else 1


def parameter_server_task_main() -> int:
    """One task of ``phalanx demo --strategy parameter_server`` (started by the launcher).

    Workers and ps tasks serve (a `phalanx.Server` each) until the launcher stops them once
    the chief is done; the chief coordinates `Model.fit`, whose steps the workers run
    asynchronously against the variables on the ps task.
    """
    import sys

    from phalanx.cluster.resolvers import TFConfigClusterResolver
    from phalanx.server import Server

    resolver = TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id or 0).join()
        return 0
    epochs, batch_size = int(sys.argv[1]), int(sys.argv[2])
    accuracy = run_demo("parameter_server", epochs=epochs, batch_size=batch_size)
    return 0 if accuracy > 0 else 1
