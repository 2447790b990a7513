"""A multi-worker program configured by TF_CONFIG alone, as in the TF guide (no launcher, no Keras).

Trains y = 3x + 0.5 with a custom loop, saves through write_dirpath (only the chief's file is
kept) and prints one JSON line with what it saw (also written to OUT_DIR/result-RANK.json).

usage: tf_config_program.py OUT_DIR
"""

import json
import os
import sys

import torch
from torch import nn

import phalanx

out_dir = sys.argv[1]
strategy = phalanx.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
resolver = strategy.cluster_resolver
torch.manual_seed(resolver.worker_index)  # different initial values: the chief's are broadcast

GLOBAL_BATCH = 16
x = torch.linspace(-1, 1, 64).unsqueeze(1)
y = 3 * x + 0.5
dataset = [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, 64, GLOBAL_BATCH)]

with strategy.scope():
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
distributed = strategy.experimental_distribute_dataset(dataset)


def train_step(xb, yb):
    per_example = (model(xb) - yb).square().squeeze(-1)
    loss = phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


for _epoch in range(15):
    for xb, yb in distributed:
        loss = strategy.reduce("sum", strategy.run(train_step, args=(xb, yb)), axis=None)

model_dir = os.path.join(out_dir, "model")
write_dir = strategy.write_dirpath(model_dir)  # every worker saves; only the chief's is kept
os.makedirs(write_dir, exist_ok=True)
torch.save(model.state_dict(), os.path.join(write_dir, "weights.pt"))
# Given a file path, write_dirpath answers as write_filepath: no folder where the chief's file goes.
torch.save(model.state_dict(), strategy.write_dirpath(os.path.join(model_dir, "final.pt")))
strategy.remove_temp_dirpath(model_dir)
result = json.dumps(
    {
        "task": f"{resolver.task_type}:{resolver.task_id}",
        "resolver": type(resolver).__name__,
        "rank": resolver.worker_index,
        "is_chief": strategy.is_chief,
        "replicas": strategy.num_replicas_in_sync,
        "loss": loss.item(),
        "weight": model.weight.item(),
        "bias": model.bias.item(),
    }
)
# A file per rank as well as stdout: processes sharing one pipe (torchrun) may interleave lines.
with open(os.path.join(out_dir, f"result-{resolver.worker_index}.json"), "w") as f:
    f.write(result)
print(result, flush=True)
strategy.close()
