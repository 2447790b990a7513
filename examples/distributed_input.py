"""TF's "Distributed input" guide (tensorflow.org/tutorials/distribute/input), ported line by line.

Run: python examples/distributed_input.py

Every code cell of the guide is here, in order, with TF's names changed to phalanx's
(``tf.distribute`` -> ``phalanx``, ``tf.data`` -> ``phalanx.data``, ``tf.config`` ->
``phalanx.config``). Where PyTorch differs the line says so: there is no ``tf.function``
to compile (the step functions run eagerly), the Keras ``StringLookup`` layer is a small
``torch.nn.Module``, and dtypes are torch's (``output_types=torch.float32``).
"""

import numpy as np
import torch
from torch import nn

import phalanx

print(phalanx.__version__)

# Simulate multiple CPUs with virtual devices
N_VIRTUAL_DEVICES = 2
physical_devices = phalanx.config.list_physical_devices("CPU")
phalanx.config.set_logical_device_configuration(
    physical_devices[0], [phalanx.config.LogicalDeviceConfiguration() for _ in range(N_VIRTUAL_DEVICES)]
)

print("Available devices:")
for i, device in enumerate(phalanx.config.list_logical_devices()):
    print(f"{i}) {device}")

# ---------------------------------------------------------------- 1. a tf.data loop, no strategy
global_batch_size = 16
# Create a phalanx.data.Dataset object.
dataset = phalanx.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)


def train_step(inputs):  # TF: @tf.function
    features, labels = inputs
    return labels - 0.3 * features


# Iterate over the dataset using the for..in construct.
for inputs in dataset:
    print(train_step(inputs))

# ---------------------------------------------------------------- 2. experimental_distribute_dataset
global_batch_size = 16
mirrored_strategy = phalanx.MirroredStrategy()

dataset = phalanx.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
# Distribute input using the `experimental_distribute_dataset`.
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
# 1 global batch of data fed to the model in 1 step.
print(next(iter(dist_dataset)))

# ---------------------------------------------------------------- 3. the auto-shard policy
dataset = phalanx.data.Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
options = phalanx.data.Options()
options.experimental_distribute.auto_shard_policy = phalanx.data.experimental.AutoShardPolicy.DATA
dataset = dataset.with_options(options)

# ---------------------------------------------------------------- 4. distribute_datasets_from_function
mirrored_strategy = phalanx.MirroredStrategy()


def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = phalanx.data.Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)  # This prefetches 2 batches per device.
    return dataset


dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)

# ---------------------------------------------------------------- 5. for..in over a distributed dataset
global_batch_size = 16
mirrored_strategy = phalanx.MirroredStrategy()

dataset = phalanx.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def train_step(inputs):  # TF: @tf.function
    features, labels = inputs
    return labels - 0.3 * features


for x in dist_dataset:
    # train_step trains the model using the dataset elements
    loss = mirrored_strategy.run(train_step, args=(x,))
    print("Loss is ", loss)

# ---------------------------------------------------------------- 6. iter and next
num_epochs = 10
steps_per_epoch = 5
for epoch in range(num_epochs):
    dist_iterator = iter(dist_dataset)
    for _step in range(steps_per_epoch):
        # train_step trains the model using the dataset elements; next(dist_iterator) is the
        # same as dist_iterator.get_next() (odd epochs use that spelling, so both run)
        batch = next(dist_iterator) if epoch % 2 == 0 else dist_iterator.get_next()
        loss = mirrored_strategy.run(train_step, args=(batch,))
        print("Loss is ", loss)

# ---------------------------------------------------------------- 7. get_next_as_optional
# You can break the loop with `get_next_as_optional` by checking if the `Optional` contains a value
global_batch_size = 4
steps_per_loop = 5
strategy = phalanx.MirroredStrategy()

dataset = phalanx.data.Dataset.range(9).batch(global_batch_size)
distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))


def train_fn(distributed_iterator):  # TF: @tf.function
    for _ in range(steps_per_loop):
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
        print(strategy.experimental_local_results(per_replica_results))


train_fn(distributed_iterator)

# ---------------------------------------------------------------- 8. element_spec
global_batch_size = 16
epochs = 5
steps_per_epoch = 5
mirrored_strategy = phalanx.MirroredStrategy()

dataset = phalanx.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
# TF: @tf.function(input_signature=[dist_dataset.element_spec]); eager PyTorch needs no
# signature, so the spec checks each replica's inputs instead.
input_signature = dist_dataset.element_spec
print("element_spec:", input_signature)


def train_step(per_replica_inputs):
    def step_fn(inputs):
        replica = phalanx.get_replica_context().replica_id_in_sync_group
        for spec, tensor in zip(input_signature.value_specs[replica], inputs, strict=True):
            assert spec.is_compatible_with(tensor), (spec, tensor.shape)
        return [2 * t for t in inputs]

    return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))


for _ in range(epochs):
    iterator = iter(dist_dataset)
    for _ in range(steps_per_epoch):
        output = train_step(next(iterator))
        print(output)

# ---------------------------------------------------------------- 9. preprocessing layers
strategy = phalanx.MirroredStrategy()
vocab = ["a", "b", "c", "d", "f"]


class StringLookup(nn.Module):
    """Keras' StringLookup: index 0 for out-of-vocabulary strings, then the vocabulary from 1."""

    def __init__(self, vocabulary):
        super().__init__()
        self.index = {word: i + 1 for i, word in enumerate(vocabulary)}

    def forward(self, words):
        return torch.tensor([self.index.get(word, 0) for word in words])


with strategy.scope():
    # Create the layer(s) under scope.
    layer = StringLookup(vocabulary=vocab)


def dataset_fn(input_context):
    # a phalanx.data.Dataset
    dataset = phalanx.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat()

    # Custom your batching, sharding, prefetching, etc.
    global_batch_size = 4
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = dataset.batch(batch_size)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    # Apply the preprocessing layer(s) to the phalanx.data.Dataset
    def preprocess_with_kpl(input):
        return layer(input)

    processed_ds = dataset.map(preprocess_with_kpl)
    return processed_ds


distributed_dataset = strategy.distribute_datasets_from_function(dataset_fn)

# Print out a few example batches.
distributed_dataset_iterator = iter(distributed_dataset)
for _ in range(3):
    print(next(distributed_dataset_iterator))

# ---------------------------------------------------------------- 10. the order of the outputs
mirrored_strategy = phalanx.MirroredStrategy()
dataset_size = 24
batch_size = 6
dataset = phalanx.data.Dataset.range(dataset_size).enumerate().batch(batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def predict(index, inputs):
    outputs = 2 * inputs
    return index, outputs


result = {}
for index, inputs in dist_dataset:
    output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
    indices = list(mirrored_strategy.experimental_local_results(output_index))
    rindices = []
    for a in indices:
        rindices.extend(a.numpy())
    outputs = list(mirrored_strategy.experimental_local_results(outputs))
    routputs = []
    for a in outputs:
        routputs.extend(a.numpy())
    for i, value in zip(rindices, routputs, strict=True):
        result[i] = value

print(result)

# ------------------------------------------- 11. experimental_distribute_values_from_function
mirrored_strategy = phalanx.MirroredStrategy()


def value_fn(ctx):
    return torch.tensor(ctx.replica_id_in_sync_group)


distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
for _ in range(4):
    result = mirrored_strategy.run(lambda x: x, args=(distributed_values,))
    print(result)

# ---------------------------------------------------------------- 12. a generator as input
mirrored_strategy = phalanx.MirroredStrategy()


def input_gen():
    while True:
        yield np.random.rand(4)


# use Dataset.from_generator
dataset = phalanx.data.Dataset.from_generator(input_gen, output_types=(torch.float32), output_shapes=(4,))
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
iterator = iter(dist_dataset)
for _ in range(4):
    result = mirrored_strategy.run(lambda x: x, args=(next(iterator),))
    print(result)

print("distributed input guide: all 12 cells ran")
