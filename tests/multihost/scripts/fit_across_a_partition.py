"""Keras-style fit with BackupAndRestore; on its first run every worker waits at a batch until the
test cut a link, so that the partition hits a known step.

Files in OUT_DIR: "at-cut-<rank>" (written when waiting at the cut), "cut" (written by the test
once the link is down), "batches-<rank>" (one line per batch this run trained: "epoch batch"),
"final-<rank>.pt" (weights, after a completed fit).

usage: fit_across_a_partition.py OUT_DIR CUT_EPOCH CUT_BATCH
"""

import os
import sys
import time

import torch
from torch import nn

import phalanx

out_dir, cut_epoch, cut_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
first_run = not os.path.exists(os.path.join(out_dir, "cut"))

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(64, 6, generator=g)
y = torch.randint(0, 3, (64,), generator=g)
with strategy.scope():
    model = phalanx.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    model.compile(optimizer="sgd", loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True))


class Record(phalanx.callbacks.Callback):
    """Logs every batch; on the first run, waits at (CUT_EPOCH, CUT_BATCH) until the link is cut."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if first_run and (self.epoch, batch) == (cut_epoch, cut_batch):
            open(os.path.join(out_dir, f"at-cut-{rank}"), "w").close()
            while not os.path.exists(os.path.join(out_dir, "cut")):
                time.sleep(0.05)

    def on_train_batch_end(self, batch, logs=None):
        with open(os.path.join(out_dir, f"batches-{rank}"), "a") as f:
            f.write(f"{self.epoch} {batch}\n")


backup = phalanx.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq="epoch")
model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[backup, Record()])
torch.save(model.module.state_dict(), os.path.join(out_dir, f"final-{rank}.pt"))
strategy.close()
