"""TF's "Custom training with tf.distribute.Strategy" tutorial, ported line by line.

Run: python examples/custom_training.py [--epochs 10] [--virtual-cpus 2] [--checkpoint-dir DIR]

tensorflow.org/tutorials/distribute/custom_training, cell by cell, with TF's names changed to
phalanx's. What differs, and why:

* Data: scikit-learn's digits (8x8 images, shipped with the package) replace Fashion-MNIST,
  which the tutorial downloads; the convolutions pad ("same") so that two poolings fit 8x8.
* ``MirroredStrategy()`` picks all GPUs, else the logical CPUs, as TF; on a CPU-only machine
  ``--virtual-cpus`` splits the CPU first (the "Distributed input" guide's first cell), so the
  loop runs on two replicas.
* PyTorch has no GradientTape, layer regularizers or tf.function: ``loss.backward()`` and
  ``optimizer.step()`` replace ``tape.gradient``/``apply_gradients``, ``model_losses``
  computes what Keras' L2 kernel regularizers add to ``model.losses``, and the step
  functions run eagerly. Keras 3 spells ``reset_states`` as ``reset_state``.
"""

import argparse
import os

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--virtual-cpus", type=int, default=2)
parser.add_argument("--checkpoint-dir", default="./training_checkpoints")
cli = parser.parse_args()

print(phalanx.__version__)

digits = load_digits()  # TF: tf.keras.datasets.fashion_mnist.load_data()
images, labels = digits.images.astype(np.float32), digits.target.astype(np.int64)
split = len(images) * 4 // 5
(train_images, train_labels), (test_images, test_labels) = (
    (images[:split], labels[:split]),
    (images[split:], labels[split:]),
)

# Add a dimension to the array -> new shape == (1, 8, 8): PyTorch puts channels first
# (batch_size, channels, height, width); batch_size dimension will be added later on.
train_images = train_images[:, None]
test_images = test_images[:, None]

# Scale the images to the [0, 1] range.
train_images = train_images / np.float32(16)
test_images = test_images / np.float32(16)

if not torch.cuda.is_available() and cli.virtual_cpus > 1:
    cpu = phalanx.config.list_physical_devices("CPU")[0]
    phalanx.config.set_logical_device_configuration(
        cpu, [phalanx.config.LogicalDeviceConfiguration() for _ in range(cli.virtual_cpus)]
    )

# If the list of devices is not specified in
# `phalanx.MirroredStrategy` constructor, they will be auto-detected.
strategy = phalanx.MirroredStrategy()

print(f"Number of devices: {strategy.num_replicas_in_sync}")

BUFFER_SIZE = len(train_images)

BATCH_SIZE_PER_REPLICA = 64
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

EPOCHS = cli.epochs

train_dataset = (
    phalanx.data.Dataset.from_tensor_slices((train_images, train_labels))
    .shuffle(BUFFER_SIZE, seed=0)
    .batch(GLOBAL_BATCH_SIZE)
)
test_dataset = phalanx.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

L2 = 1e-5  # TF: regularizer = tf.keras.regularizers.L2(1e-5) on every kernel


def create_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding="same"),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding="same"),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 2 * 2, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )

    return model


def model_losses(model):
    """What Keras' kernel regularizers put in ``model.losses``: L2 * sum(kernel ** 2) per layer."""
    return [L2 * layer.weight.square().sum() for layer in model if isinstance(layer, (nn.Conv2d, nn.Linear))]


# Create a checkpoint directory to store the checkpoints.
checkpoint_dir = cli.checkpoint_dir
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

with strategy.scope():
    # Set reduction to `None` so you can do the reduction yourself.
    loss_object = phalanx.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def compute_loss(labels, predictions, model_losses):
        per_example_loss = loss_object(labels, predictions)
        loss = phalanx.compute_average_loss(per_example_loss)
        if model_losses:
            loss += phalanx.scale_regularization_loss(sum(model_losses))
        return loss


with strategy.scope():
    test_loss = phalanx.metrics.Mean(name="test_loss")

    train_accuracy = phalanx.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = phalanx.metrics.SparseCategoricalAccuracy(name="test_accuracy")

# A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
with strategy.scope():
    model = create_model()

    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)

    checkpoint = phalanx.checkpoint.Checkpoint(optimizer=optimizer, model=model)


def train_step(inputs):
    images, labels = inputs

    predictions = model(images)  # TF: training=True (this model has no dropout or batch norm)
    loss = compute_loss(labels, predictions, model_losses(model))

    loss.backward()  # TF: tape.gradient(loss, model.trainable_variables)
    optimizer.step()  # TF: optimizer.apply_gradients(zip(gradients, ...))
    optimizer.zero_grad()

    train_accuracy.update_state(labels, predictions)
    return loss


def test_step(inputs):
    images, labels = inputs

    with torch.no_grad():  # TF: training=False, and no tape
        predictions = model(images)
    t_loss = loss_object(labels, predictions)

    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


# `run` replicates the provided computation and runs it
# with the distributed input.
def distributed_train_step(dataset_inputs):  # TF: @tf.function
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(phalanx.ReduceOp.SUM, per_replica_losses, axis=None)


def distributed_test_step(dataset_inputs):  # TF: @tf.function
    return strategy.run(test_step, args=(dataset_inputs,))


for epoch in range(EPOCHS):
    # TRAIN LOOP
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches

    # TEST LOOP
    for x in test_dist_dataset:
        distributed_test_step(x)

    if epoch % 2 == 0:
        checkpoint.save(checkpoint_prefix)

    template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
    print(
        template.format(
            epoch + 1,
            train_loss,
            train_accuracy.result() * 100,
            test_loss.result(),
            test_accuracy.result() * 100,
        )
    )

    test_loss.reset_state()  # TF: reset_states
    train_accuracy.reset_state()
    test_accuracy.reset_state()

# ---------------------------------------------------------------- restore without a strategy
eval_accuracy = phalanx.metrics.SparseCategoricalAccuracy(name="eval_accuracy")

new_model = create_model()
new_optimizer = torch.optim.Adam(new_model.parameters())

test_dataset = phalanx.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)


def eval_step(images, labels):  # TF: @tf.function
    with torch.no_grad():
        predictions = new_model(images)  # TF: training=False
    eval_accuracy(labels, predictions)


checkpoint = phalanx.checkpoint.Checkpoint(optimizer=new_optimizer, model=new_model)
checkpoint.restore(phalanx.checkpoint.latest_checkpoint(checkpoint_dir))

for images, labels in test_dataset:
    eval_step(images, labels)

print(f"Accuracy after restoring the saved model without strategy: {eval_accuracy.result() * 100}")

# ---------------------------------------------------------------- iterating in a non-pythonic way
for _ in range(EPOCHS):
    total_loss = 0.0
    num_batches = 0
    train_iter = iter(train_dist_dataset)

    for _ in range(10):
        total_loss += distributed_train_step(next(train_iter))
        num_batches += 1
    average_train_loss = total_loss / num_batches

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    print(template.format(epoch + 1, average_train_loss, train_accuracy.result() * 100))
    train_accuracy.reset_state()


# ---------------------------------------------------------------- iterating inside a function
def distributed_train_epoch(dataset):  # TF: @tf.function
    total_loss = 0.0
    num_batches = 0
    for x in dataset:
        per_replica_losses = strategy.run(train_step, args=(x,))
        total_loss += strategy.reduce(phalanx.ReduceOp.SUM, per_replica_losses, axis=None)
        num_batches += 1
    return total_loss / float(num_batches)  # TF: tf.cast(num_batches, dtype=tf.float32)


for epoch in range(EPOCHS):
    train_loss = distributed_train_epoch(train_dist_dataset)

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    print(template.format(epoch + 1, train_loss, train_accuracy.result() * 100))

    train_accuracy.reset_state()
