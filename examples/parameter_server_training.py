"""TF's parameter-server training tutorial (custom loop), ported: a chief coordinates, workers
train asynchronously, ps tasks hold the variables and the optimizer state.

Run: phalanx launch --chief --workers 2 --ps 1 examples/parameter_server_training.py [--epochs N]
(or start it once per task yourself with TF_CONFIG and PHALANX_CLUSTER_TOKEN set).
"""

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--steps-per-epoch", type=int, default=40)
args = parser.parse_args()

resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    # Workers run the functions the coordinator schedules; ps tasks hold the variables.
    server = phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id)
    server.join()  # until the launcher stops the task, once the chief is done
    raise SystemExit(0)

strategy = phalanx.ParameterServerStrategy(resolver)
coordinator = phalanx.coordinator.ClusterCoordinator(strategy)

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target, dtype=torch.int64)
global_batch_size = 64

with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)


def dataset_fn(input_context):
    # Each worker shuffles its own copy, repeated forever: steps are counted by the coordinator.
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    g = torch.Generator().manual_seed(input_context.input_pipeline_id)
    while True:
        order = torch.randperm(len(x), generator=g)
        for start in range(0, len(x) - batch_size + 1, batch_size):
            rows = order[start : start + batch_size]
            yield x[rows], y[rows]


per_worker_iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))


def train_step(iterator):
    def replica_fn(features, labels):
        logits = model(features)
        per_example_loss = nn.functional.cross_entropy(logits, labels, reduction="none")
        loss = phalanx.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # the gradients go to the ps tasks, which apply them
        accuracy = (logits.argmax(1) == labels).float().mean()
        return loss.detach(), accuracy

    features, labels = next(iterator)
    return strategy.run(replica_fn, args=(features, labels))


for epoch in range(args.epochs):
    results = [
        coordinator.schedule(train_step, args=(per_worker_iterator,)) for _ in range(args.steps_per_epoch)
    ]
    coordinator.join()
    losses, accuracies = zip(*(r.fetch() for r in results), strict=True)
    print(f"Epoch {epoch + 1}: loss {np.mean(losses):.4f}, accuracy {np.mean(accuracies):.3f}")

# The coordinator's copy of the model reads the trained values from the ps tasks.
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
print(f"final accuracy on all digits: {accuracy:.3f}")
