"""The guide's custom training loop: compute_average_loss, strategy.run, strategy.reduce.

Run: python examples/custom_training_loop.py [--epochs N]
"""

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

GLOBAL_BATCH_SIZE = 64
strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])

digits = load_digits()
x = torch.from_numpy((digits.data / 16.0).astype(np.float32))
y = torch.from_numpy(digits.target.astype(np.int64))
dataset = phalanx.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).batch(GLOBAL_BATCH_SIZE)
dist_dataset = strategy.experimental_distribute_dataset(dataset)

with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_accuracy = phalanx.metrics.SparseCategoricalAccuracy()


def train_step(inputs, labels):
    logits = model(inputs)
    per_example_loss = nn.functional.cross_entropy(logits, labels, reduction="none")
    loss = phalanx.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    train_accuracy.update_state(labels, logits.detach())
    return loss


for epoch in range(args.epochs):
    total_loss, num_batches = 0.0, 0
    for inputs, labels in dist_dataset:
        per_replica_losses = strategy.run(train_step, args=(inputs, labels))
        total_loss += strategy.reduce(phalanx.ReduceOp.SUM, per_replica_losses, axis=None).item()
        num_batches += 1
    print(
        f"Epoch {epoch + 1}, Loss: {total_loss / num_batches:.4f}, "
        f"Accuracy: {train_accuracy.result().item():.4f}"
    )
    train_accuracy.reset_state()
