"""Keras callbacks for `Model.fit` (phalanx.callbacks), with Keras' hook names."""

from phalanx.callbacks.callback import Callback, CallbackList
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.history import History
from phalanx.callbacks.learning_rate import LearningRateScheduler, ReduceLROnPlateau
from phalanx.callbacks.logging_callbacks import CSVLogger, LambdaCallback, TensorBoard, TerminateOnNaN
from phalanx.callbacks.model_checkpoint import ModelCheckpoint
from phalanx.callbacks.progbar import ProgbarLogger

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
]


def __getattr__(name: str) -> object:
    # BackupAndRestore lives with the training loop it resumes; import it lazily (no cycle).
    if name == "BackupAndRestore":
        from phalanx.keras.backup_and_restore import BackupAndRestore

        return BackupAndRestore
    raise AttributeError(name)
