"""Workers with different amounts of data end the epoch on the same step (empty batches + agreement).

Three inputs: distribute_datasets_from_function (worker 0 has 2 batches, worker 1 has 4),
FILE auto-sharding of 3 files of different lengths, and OFF sharding of per-worker datasets of
different lengths. Writes ``steps-<rank>.json`` to OUT_DIR, with how many end-of-data
all-reduces the worker made (``agreements``).

usage: uneven_epoch.py OUT_DIR [wide]
  wide: a model whose gradients gloo announces, so the next step's end-of-data flag rides with
        each step's gradients (phalanx.communication.transports.gloo.transport)
"""

import json
import os
import sys

import numpy as np
import torch
from torch import nn

import phalanx
from phalanx.data import Dataset, Options

out_dir = sys.argv[1]
wide = sys.argv[2:] == ["wide"]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
with strategy.scope():
    model = nn.Sequential(nn.Linear(3, 512), nn.Linear(512, 1)) if wide else nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
agreements = 0
agree = strategy.any_worker_has_data


def counted(has_data):
    global agreements
    agreements += 1
    return agree(has_data)


strategy.any_worker_has_data = counted


def step(x):
    phalanx.compute_average_loss(model(x).squeeze(-1), global_batch_size=8).backward()
    optimizer.step()
    optimizer.zero_grad()


def train(dataset):
    sizes = []
    for batch in dataset:
        sizes.append(batch.shape[0])
        strategy.run(step, args=(batch,))
    return sizes


def dataset_fn(ctx):
    # worker 0 has 2 batches, worker 1 has 4
    return [torch.ones(4, 3) * (i + 1) for i in range(2 + 2 * ctx.input_pipeline_id)]


from_function = []
for _epoch in range(2):
    from_function += train(strategy.distribute_datasets_from_function(dataset_fn))

# FILE: files 0 and 2 (24 + 8 rows) go to worker 0, file 1 (8 rows) to worker 1
files = []
for i, rows in enumerate([24, 8, 8]):
    path = os.path.join(out_dir, f"part-{i}.npy")
    if rank == 0:
        np.save(path, np.full((rows, 3), float(i + 1), dtype=np.float32))
    files.append(path)
strategy.run(lambda: phalanx.get_replica_context().all_reduce("sum", torch.ones(1)))  # files written


def read(path):
    return Dataset.from_tensor_slices(torch.from_numpy(np.load(path)))


by_file = Dataset.from_files(files, read).batch(8)
file_sharded = train(strategy.experimental_distribute_dataset(by_file))

# OFF: every worker reads its own dataset whole; worker 1's is shorter
off = Options()
off.experimental_distribute.auto_shard_policy = "OFF"
own = Dataset.from_tensor_slices(torch.ones(8 * (3 - rank), 3)).batch(8).with_options(off)
not_sharded = train(strategy.experimental_distribute_dataset(own))

with open(os.path.join(out_dir, f"steps-{rank}.json"), "w") as f:
    json.dump(
        {
            "sizes": from_function,
            "file": file_sharded,
            "off": not_sharded,
            "weight": [p.detach().tolist() for p in model.parameters()],
            "agreements": agreements,
        },
        f,
    )
strategy.close()
