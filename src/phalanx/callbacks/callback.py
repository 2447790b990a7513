"""Callback: the base of every callback, with Keras' hook names so users' callbacks port as is.

Under several workers every worker runs every callback, in the same order: a hook may
read a metric (a collective) or save the model (all workers take part). Only the writing of
files is the chief's (see `phalanx.strategies.workers.distributed_files`), and only the chief prints.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Callback", "Logs", "batch_ends"]

Logs = dict[str, Any] | None
_BATCH_ENDS = {"train": ("on_train_batch_end", "on_batch_end"), "test": ("on_test_batch_end",)}


def batch_ends(mode: str) -> tuple[str, ...]:
    """The hooks that get a step's logs in ``mode`` ("train" or "test").

    Raises:
        ValueError: Another mode.
    """
    hooks = _BATCH_ENDS.get(mode)
    if hooks is None:
        raise ValueError(
            f'reads_batch_logs takes mode "train" or "test". Received: {mode!r}. HINT: predict '
            "hands its batch hooks outputs, not logs."
        )
    return hooks


class Callback:
    """Base class: override the hooks you need. `Model.fit` sets ``model`` and ``params``.

    Attributes:
        model: The model being trained; callbacks may use ``model.stop_training``,
            ``model.optimizer`` (a ``torch.optim.Optimizer``), ``model.strategy``,
            ``model.state_dict()``/``load_state_dict()``, ``model.save(path)`` and
            ``model.save_weights(path)``.
        params: Run parameters: ``verbose``, ``epochs``, ``steps`` (None when unknown).
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        """Binds the callback to ``model``."""
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        """Sets the run parameters."""
        self.params = params

    def on_train_begin(self, logs: Logs = None) -> None:
        """Called at the start of `fit`."""

    def on_train_end(self, logs: Logs = None) -> None:
        """Called at the end of `fit` with the last epoch's logs."""

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        """Called at the start of epoch ``epoch`` (0-based)."""

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        """Called at the end of an epoch with its logs (validation keys start with ``val_``)."""

    def on_batch_begin(self, batch: int, logs: Logs = None) -> None:
        """Keras' old name for `on_train_batch_begin` (which calls it)."""

    def on_batch_end(self, batch: int, logs: Logs = None) -> None:
        """Keras' old name for `on_train_batch_end` (which calls it)."""

    def reads_batch_logs(self, mode: str = "train") -> bool:
        """Whether this callback reads the logs its batch hooks are handed, in training
        (``mode="train"``: ``on_train_batch_end``) or evaluation (``"test"``: ``on_test_batch_end``).

        A step's global logs cost a cross-worker sum of every metric's state, so `fit` and
        `evaluate` make them only when some callback reads them (as Keras 2 called batch hooks
        only when a callback implemented them); otherwise the batch hooks get empty logs. The
        answer must be the same on every worker (every worker runs the same callbacks).
        Default: whether the callback's class or the callback itself overrides that hook (in
        training, ``on_batch_end`` too); a callback whose batch hook never reads its logs says
        False.

        Raises:
            ValueError: ``mode`` is neither "train" nor "test".
        """
        return any(
            name in vars(self) or getattr(type(self), name) is not getattr(Callback, name)
            for name in batch_ends(mode)
        )

    def on_train_batch_begin(self, batch: int, logs: Logs = None) -> None:
        """Called before training step ``batch`` (0-based within the epoch)."""
        self.on_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        """Called after training step ``batch`` with the running logs of the epoch."""
        self.on_batch_end(batch, logs)

    def on_test_begin(self, logs: Logs = None) -> None:
        """Called at the start of `evaluate` (and of validation inside `fit`)."""

    def on_test_end(self, logs: Logs = None) -> None:
        """Called at the end of `evaluate` with its logs."""

    def on_test_batch_begin(self, batch: int, logs: Logs = None) -> None:
        """Called before evaluation step ``batch``."""

    def on_test_batch_end(self, batch: int, logs: Logs = None) -> None:
        """Called after evaluation step ``batch`` with the running logs."""

    def on_predict_begin(self, logs: Logs = None) -> None:
        """Called at the start of `predict`."""

    def on_predict_end(self, logs: Logs = None) -> None:
        """Called at the end of `predict`."""

    def on_predict_batch_begin(self, batch: int, logs: Logs = None) -> None:
        """Called before prediction step ``batch``."""

    def on_predict_batch_end(self, batch: int, logs: Logs = None) -> None:
        """Called after prediction step ``batch``."""
