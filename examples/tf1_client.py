"""The TF1 article's client: a process that is not a task of the cluster drives it.

TF1 opens ``tf.Session("grpc://worker0:2222")`` and places variables with ``tf.device``;
phalanx creates a ``ParameterServerStrategy`` from the cluster alone (no task of its own):
variables live on the ps tasks, the functions it schedules run on the worker tasks.

Run: start every task with examples/tf1_server.py, then
    python examples/tf1_client.py --cluster '{"worker": [...], "ps": [...]}' [--steps N]
with the same PHALANX_CLUSTER_TOKEN.
"""

import argparse
import json

import torch

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--cluster", required=True, help="the cluster spec, as JSON: job -> addresses")
parser.add_argument("--steps", type=int, default=60)
args = parser.parse_args()

cluster = phalanx.train.ClusterSpec(json.loads(args.cluster))
resolver = phalanx.cluster_resolver.SimpleClusterResolver(cluster)  # no task_type: a client
strategy = phalanx.ParameterServerStrategy(resolver)
coordinator = phalanx.coordinator.ClusterCoordinator(strategy)

torch.manual_seed(0)
true_w = torch.tensor([[2.0], [-3.0], [0.5]])
with strategy.scope():  # the variables are created on the ps tasks
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step():
    def replica_fn():
        x = torch.randn(32, 3)
        loss = (model(x) - x @ true_w).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # the gradients go to the ps tasks, which apply them
        return loss.detach()

    return strategy.run(replica_fn), strategy.worker_index


results = [coordinator.schedule(train_step) for _ in range(args.steps)]
coordinator.join()
losses = [loss.item() for loss, _ in (r.fetch() for r in results)]
workers = sorted({worker for _, worker in (r.fetch() for r in results)})
print(f"steps ran on workers {workers}")
print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
print(f"weights: {[round(w, 2) for w in model.weight.detach().flatten().tolist()]}")
