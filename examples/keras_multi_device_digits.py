"""The complete multi-GPU training example, ported: a CNN with EarlyStopping and ModelCheckpoint.

Runs on two logical CPU replicas here; MirroredStrategy() uses every GPU when there are some.
Run: python examples/keras_multi_device_digits.py [--epochs N] [--checkpoint-dir DIR]
"""

import argparse
import os
import tempfile

import numpy as np
from sklearn.datasets import load_digits
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--checkpoint-dir", default=tempfile.mkdtemp())
args = parser.parse_args()

digits = load_digits()
x = (digits.images / 16.0).astype(np.float32)[:, None]
y = digits.target.astype(np.int64)
x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
with strategy.scope():
    model = phalanx.Model(
        nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(64, 10),
        )
    )
    model.compile(
        optimizer="adam",
        loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

callbacks = [
    phalanx.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
    phalanx.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, "best.pt"), monitor="val_loss", save_best_only=True
    ),
]
model.fit(
    x_train, y_train, batch_size=64, epochs=args.epochs, validation_split=0.2, callbacks=callbacks, verbose=2
)
loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
print(f"test loss {loss:.4f}, test accuracy {accuracy:.4f}")
