"""The strategies overview's performance tips, ported: mixed precision (torch.autocast inside
strategy.run), SyncBatchNorm, jit_compile (torch.compile) and an input pipeline with parallel
map, cache and prefetch. Each tip trains a few steps under MirroredStrategy on logical CPUs.

Run: python examples/performance_tips.py [--skip-compile]
"""

import argparse

import torch
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--skip-compile", action="store_true", help="skip the torch.compile tip")
args = parser.parse_args()

strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
GLOBAL_BATCH = 64
features, labels = torch.randn(512, 32), torch.randint(0, 4, (512,))


# -- Input pipeline: parallel map, cache, prefetch (tf.data's tips).
def augment(x, y):
    return x + 0.01 * torch.randn_like(x), y


dataset = (
    phalanx.data.Dataset.from_tensor_slices((features, labels))
    .cache()  # after the expensive, deterministic steps
    .shuffle(512, seed=0)
    .map(augment, num_parallel_calls=phalanx.data.AUTOTUNE)  # on a thread pool, order kept
    .batch(GLOBAL_BATCH, drop_remainder=True)
    .prefetch(phalanx.data.AUTOTUNE)  # the next batches are ready while a step runs
)
dist_dataset = strategy.experimental_distribute_dataset(dataset)

# -- SyncBatchNorm: statistics of the whole global batch, across replicas (and workers).
with strategy.scope():
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    model = phalanx.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
print("converted:", type(model[1]).__name__)


# -- Mixed precision: autocast inside the replica function; the loss is computed in float32.
def train_step(x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):  # "cuda" with float16/bfloat16 on GPUs
        logits = model(x)
    per_example = nn.functional.cross_entropy(logits.float(), y, reduction="none")
    loss = phalanx.compute_average_loss(per_example)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach(), logits.dtype


for x, y in dist_dataset:
    loss, dtype = strategy.run(train_step, args=(x, y))
    loss = strategy.reduce("sum", loss, axis=None)
print(f"mixed precision: computed in {strategy.experimental_local_results(dtype)[0]}, loss {loss.item():.4f}")

# -- jit_compile: Model.compile(jit_compile=True) runs the module through torch.compile.
if not args.skip_compile:
    with strategy.scope():
        keras_model = phalanx.Model(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
        keras_model.compile(
            optimizer="adam",
            loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=True,
        )
    history = keras_model.fit(features, labels, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    print(f"jit_compile: loss {history.history['loss'][-1]:.4f}")
print("done")
