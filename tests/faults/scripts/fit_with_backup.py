"""Trains with BackupAndRestore; optionally SIGKILLs itself at (epoch, batch) on its first run.

usage: fit_with_backup.py BACKUP_DIR OUT_FILE SAVE_FREQ KILL_EPOCH KILL_BATCH STRATEGY

STRATEGY: one_device, mirrored_2cpu, central_storage_2cpu, or multi_worker (a task of a cluster).
"""

import os
import signal
import sys

import torch
from torch import nn

import phalanx
from support.strategies import IN_PROCESS

backup_dir, out_file, save_freq, kill_epoch, kill_batch, strategy_name = sys.argv[1:7]
save_freq = save_freq if save_freq == "epoch" else int(save_freq)
marker = os.path.join(os.path.dirname(out_file), "killed-once")

# a named in-process strategy (tests/support/strategies.py), or one worker of several from TF_CONFIG
make = phalanx.MultiWorkerMirroredStrategy if strategy_name == "multi_worker" else IN_PROCESS[strategy_name]
strategy = make()
resolver = strategy.cluster_resolver
killer = resolver is None or resolver.worker_index == resolver.num_workers - 1  # one worker of several

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(100, 6, generator=g)
y = torch.randint(0, 3, (100,), generator=g)
with strategy.scope():
    model = phalanx.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)))
    model.compile(
        optimizer="adam",
        loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


class KillAt(phalanx.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (
            killer
            and int(kill_epoch) >= 0
            and not os.path.exists(marker)
            and (self.epoch, batch) == (int(kill_epoch), int(kill_batch))
        ):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


backup = phalanx.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)
history = model.fit(x, y, batch_size=16, epochs=4, shuffle=True, verbose=0, callbacks=[backup, KillAt()])
if strategy.is_chief:
    torch.save({"weights": model.module.state_dict(), "loss": history.history["loss"]}, out_file)
