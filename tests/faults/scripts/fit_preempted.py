"""Model.fit with BackupAndRestore(save_before_preemption=True), one task of a MultiWorkerMirrored cluster.

usage: fit_preempted.py BACKUP_DIR OUT_FILE SLEEP_SECONDS

SLEEP_SECONDS: a pause after each batch (it changes no number; it keeps the run long enough
for the test to SIGTERM a worker mid-way). After each batch every task writes how many batches
it has done to BACKUP_DIR/../progress-<rank>. The chief writes the final weights to OUT_FILE.
"""

import os
import sys
import time

import torch
from torch import nn

import phalanx

backup_dir, out_file, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])
folder = os.path.dirname(os.path.abspath(backup_dir))
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.worker_rank

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(96, 6, generator=g)
y = torch.randint(0, 3, (96,), generator=g)
with strategy.scope():
    model = phalanx.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)))
    model.compile(
        optimizer="adam",
        loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


class Progress(phalanx.callbacks.Callback):
    batches = 0

    def on_train_batch_end(self, batch, logs=None):
        Progress.batches += 1
        with open(os.path.join(folder, f"progress-{rank}"), "w") as f:
            f.write(str(Progress.batches))
        time.sleep(pause)


backup = phalanx.callbacks.BackupAndRestore(backup_dir, save_before_preemption=True)
history = model.fit(x, y, batch_size=16, epochs=15, shuffle=True, verbose=0, callbacks=[backup, Progress()])
if strategy.is_chief:
    torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, out_file)
print("done", flush=True)
