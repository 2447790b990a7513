"""Keras callbacks for `Model.fit` (``phalanx.callbacks``), with Keras' names and hooks.

Every worker runs every callback, so reads that are collectives stay in step; files are
written by the chief only (others write a temporary copy that is removed), and only the
chief prints.
"""

from phalanx.callbacks.backup_and_restore import BackupAndRestore
from phalanx.callbacks.callback import Callback
from phalanx.callbacks.callback_list import CallbackList
from phalanx.callbacks.csv_logger import CSVLogger
from phalanx.callbacks.early_stopping import EarlyStopping
from phalanx.callbacks.history import History
from phalanx.callbacks.lambda_callback import LambdaCallback
from phalanx.callbacks.learning_rate_scheduler import LearningRateScheduler
from phalanx.callbacks.model_checkpoint import ModelCheckpoint
from phalanx.callbacks.monitor_callback import MonitorCallback
from phalanx.callbacks.progbar_logger import ProgbarLogger
from phalanx.callbacks.reduce_lr_on_plateau import ReduceLROnPlateau
from phalanx.callbacks.tensorboard import TensorBoard
from phalanx.callbacks.terminate_on_nan import TerminateOnNaN

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
    "MonitorCallback",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
]
