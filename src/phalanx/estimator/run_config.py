"""RunConfig: where an Estimator saves, and which task of a cluster this is (tf.estimator.RunConfig)."""

from __future__ import annotations

import os
from typing import Any

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.resolvers import TFConfigClusterResolver

__all__ = ["RunConfig"]


class RunConfig:
    """An Estimator's run configuration; the cluster and this task come from ``TF_CONFIG``.

    Without ``TF_CONFIG`` the Estimator trains locally (task ``None``, chief). With it, the
    task is one of ``chief``, ``worker``, ``ps`` or ``evaluator``, and `train_and_evaluate`
    runs that role.

    Args:
        model_dir: Checkpoints and summaries (the Estimator's ``model_dir`` wins if both given).
        tf_random_seed: Seeds torch before the model is built (None: no seeding).
        save_summary_steps: Global steps between two summaries of the training loss.
        save_checkpoints_steps, save_checkpoints_secs: How often the chief saves (at most one;
            neither: every 600 s).
        keep_checkpoint_max: Checkpoints kept.
        log_step_count_steps: Global steps between two ``global_step/sec`` logs.
        train_distribute: Not supported (see Raises).

    Raises:
        ValueError: Both ``save_checkpoints_steps`` and ``save_checkpoints_secs``; or a
            ``train_distribute`` strategy.
    """

    def __init__(
        self,
        model_dir: str | None = None,
        tf_random_seed: int | None = None,
        save_summary_steps: int | None = 100,
        save_checkpoints_steps: int | None = None,
        save_checkpoints_secs: float | None = None,
        keep_checkpoint_max: int | None = 5,
        log_step_count_steps: int | None = 100,
        train_distribute: Any = None,
    ) -> None:
        if save_checkpoints_steps is not None and save_checkpoints_secs is not None:
            raise ValueError(
                "RunConfig takes at most one of save_checkpoints_steps and save_checkpoints_secs. "
                f"Received: {save_checkpoints_steps!r} and {save_checkpoints_secs!r}."
            )
        if train_distribute is not None:
            raise ValueError(
                "An Estimator distributes through the cluster in TF_CONFIG (ps tasks, between-graph "
                f"replication), not through a strategy. Received: train_distribute={train_distribute!r}. "
                "HINT: set TF_CONFIG with chief/worker/ps tasks and call train_and_evaluate, or train a "
                "phalanx.Model with model.fit under the strategy."
            )
        self.model_dir = model_dir
        self.tf_random_seed = tf_random_seed
        self.save_summary_steps = save_summary_steps
        self.save_checkpoints_steps = save_checkpoints_steps
        self.save_checkpoints_secs = (
            600.0
            if save_checkpoints_steps is None and save_checkpoints_secs is None
            else save_checkpoints_secs
        )
        self.keep_checkpoint_max = keep_checkpoint_max
        self.log_step_count_steps = log_step_count_steps
        self._resolver = TFConfigClusterResolver() if os.environ.get("TF_CONFIG") else None

    @property
    def cluster_resolver(self) -> TFConfigClusterResolver | None:
        """The cluster and this task, from ``TF_CONFIG`` (None: local)."""
        return self._resolver

    @property
    def cluster_spec(self) -> ClusterSpec | None:
        """The cluster (None: local)."""
        return self._resolver.cluster_spec() if self._resolver else None

    @property
    def task_type(self) -> str | None:
        """``chief``, ``worker``, ``ps``, ``evaluator``, or None (local)."""
        return self._resolver.task_type if self._resolver else None

    @property
    def task_id(self) -> int:
        """This task's index in its job (0 locally)."""
        return int(self._resolver.task_id or 0) if self._resolver else 0

    @property
    def is_chief(self) -> bool:
        """Whether this task restores, initialises and saves (local: True)."""
        return self._resolver.is_chief if self._resolver else True

    @property
    def num_worker_replicas(self) -> int:
        """The training tasks: chief and workers (1 locally)."""
        spec = self.cluster_spec
        if spec is None:
            return 1
        return sum(spec.num_tasks(job) for job in ("chief", "worker") if job in spec.jobs)

    @property
    def num_ps_replicas(self) -> int:
        """The ps tasks (0 locally)."""
        spec = self.cluster_spec
        return spec.num_tasks("ps") if spec is not None and "ps" in spec.jobs else 0

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (tf.estimator.RunConfig.replace)."""
        fields = {
            "model_dir": self.model_dir,
            "tf_random_seed": self.tf_random_seed,
            "save_summary_steps": self.save_summary_steps,
            "save_checkpoints_steps": self.save_checkpoints_steps,
            "save_checkpoints_secs": None
            if self.save_checkpoints_steps is not None
            else self.save_checkpoints_secs,
            "keep_checkpoint_max": self.keep_checkpoint_max,
            "log_step_count_steps": self.log_step_count_steps,
        }
        return RunConfig(**{**fields, **changes})
