"""The distributed-training guide's Keras example, ported: a Dense model, fit under MirroredStrategy.

Run: python examples/keras_guide.py [--epochs N]
"""

import argparse

import torch
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])  # or MirroredStrategy() for all GPUs
print(f"Number of devices: {strategy.num_replicas_in_sync}")

with strategy.scope():
    model = phalanx.Model(nn.Sequential(nn.Linear(1, 1)))
    model.compile(loss="mse", optimizer="sgd")

# dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(10)
dataset = phalanx.data.Dataset.from_tensors((torch.tensor([1.0]), torch.tensor([1.0]))).repeat(100).batch(10)
model.fit(dataset, epochs=args.epochs)
print("evaluate:", model.evaluate(dataset))
