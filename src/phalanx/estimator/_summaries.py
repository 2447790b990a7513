"""TensorBoard summaries of an evaluation (TF writes them to ``model_dir/eval``)."""

from __future__ import annotations

import logging

from phalanx.train.hooks import summary_writer
from phalanx.train.session import tensorboard_available

__all__ = ["write_eval_summaries"]

log = logging.getLogger("phalanx")


def write_eval_summaries(folder: str, metrics: dict[str, float], global_step: int) -> None:
    """Writes every metric at ``global_step`` to ``folder`` (nothing without ``tensorboard``)."""
    if not tensorboard_available():
        log.info("No evaluation summaries: pip install 'phalanx[tensorboard]' to write them.")
        return
    writer = summary_writer(folder)
    for name, value in metrics.items():
        if name != "global_step":
            writer.add_scalar(name, value, global_step)
    writer.flush()
