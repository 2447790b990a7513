"""Workers with different amounts of data end the epoch on the same step (empty batches + agreement)."""

import json
import os
import sys

import torch
from torch import nn

import phalanx

out_dir = sys.argv[1]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
with strategy.scope():
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def dataset_fn(ctx):
    # worker 0 has 2 batches, worker 1 has 4
    return [torch.ones(4, 3) * (i + 1) for i in range(2 + 2 * ctx.input_pipeline_id)]


sizes = []
for _epoch in range(2):
    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        sizes.append(batch.shape[0])

        def step(x):
            phalanx.compute_average_loss(model(x).squeeze(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()

        strategy.run(step, args=(batch,))
with open(os.path.join(out_dir, f"steps-{rank}.json"), "w") as f:
    json.dump({"sizes": sizes, "weight": model.weight.detach().tolist()}, f)
strategy.close()
