"""TF's multi-worker Keras tutorial, ported: two workers from TF_CONFIG, BackupAndRestore, chief saves.

Run: phalanx launch --workers 2 examples/multi_worker_keras.py [--epochs N] [--model-dir DIR]
(or start it once per task yourself with TF_CONFIG set, as on Kubernetes).
"""

import argparse
import os
import tempfile

import numpy as np
from sklearn.datasets import load_digits
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "phalanx-multi-worker"))
args = parser.parse_args()

per_worker_batch_size = 32
strategy = phalanx.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
global_batch_size = per_worker_batch_size * strategy.num_replicas_in_sync

digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
y = digits.target.astype(np.int64)

with strategy.scope():
    model = phalanx.Model(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    model.compile(
        optimizer="adam",
        loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

backup = phalanx.callbacks.BackupAndRestore(backup_dir=os.path.join(args.model_dir, "backup"))
model.fit(x, y, batch_size=global_batch_size, epochs=args.epochs, callbacks=[backup], verbose=2)

# Every worker saves (the save may read aggregated values); only the chief's file is kept.
model.save(os.path.join(args.model_dir, "model.pt"))
if strategy.is_chief:
    print("saved", os.path.exists(os.path.join(args.model_dir, "model.pt")))
    # A torch.nn-only model loads without its class (TF's tf.keras.models.load_model), here
    # outside any strategy scope: a plain single-device model for inspection or serving.
    restored = phalanx.load_model(os.path.join(args.model_dir, "model.pt"))
    _, accuracy = restored.evaluate(x, y, verbose=0)
    print(f"restored model accuracy: {accuracy:.3f}")
