"""One phalanx program for Kubeflow's three job kinds: TFJob, PyTorchJob and TrainJob.

Run: kubectl apply -f examples/kubeflow/tfjob.yaml   (or pytorchjob.yaml, trainjob.yaml; docs/clusters.md)

The program reads its cluster from whatever the operator set: TFJob's ``TF_CONFIG``
(``"environment": "cloud"``, the evaluator outside ``cluster``), PyTorchJob's ``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` (no ``LOCAL_RANK``), or, under a TrainJob, the
variables torchrun sets from the runtime's ``PET_*``. The training tasks fit a small regression
with MultiWorkerMirroredStrategy and save a checkpoint into OUT_DIR/checkpoints; the chief
writes OUT_DIR/weights.pt and OUT_DIR/result.json (the final loss). A TFJob's evaluator task
evaluates the checkpoint with SidecarEvaluator and writes OUT_DIR/evaluation.json.

usage: train.py OUT_DIR [--epochs N]
"""

import argparse
import json
import os

import torch
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--epochs", type=int, default=4)
args = parser.parse_args()
checkpoints = os.path.join(args.out_dir, "checkpoints")

# the same data on every task: y = x @ w + 0.5 plus noise, from a fixed seed
g = torch.Generator().manual_seed(0)
x = torch.randn(128, 8, generator=g)
y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.5 + 0.05 * torch.randn(128, 1, generator=g)


def build() -> phalanx.Model:
    torch.manual_seed(1)
    model = phalanx.Model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    model.compile(optimizer="sgd", loss="mse")
    return model


resolver = phalanx.cluster.resolve_cluster()  # TF_CONFIG, else RANK/WORLD_SIZE, else one process
if resolver.task_type == "evaluator":  # a TFJob's Evaluator replica: outside the training cluster
    results = phalanx.SidecarEvaluator(build(), (x, y), checkpoints, max_evaluations=1).start()
    with open(os.path.join(args.out_dir, "evaluation.json"), "w") as f:
        json.dump({"loss": results[-1]["loss"]}, f)
    raise SystemExit(0)

strategy = phalanx.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
with strategy.scope():
    model = build()
model.fit(x, y, batch_size=32, epochs=args.epochs, shuffle=False, verbose=0)
manager = phalanx.checkpoint.CheckpointManager(phalanx.checkpoint.Checkpoint(model=model), checkpoints, 1)
manager.save()  # every worker; the chief's files are kept
loss = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
if strategy.is_chief:
    torch.save(model.module.state_dict(), os.path.join(args.out_dir, "weights.pt"))
    with open(os.path.join(args.out_dir, "result.json"), "w") as f:
        json.dump({"loss": loss, "workers": strategy.num_workers_in_sync}, f)
print(f"{resolver.task_type}:{resolver.task_id} done, loss {loss:.6f}", flush=True)
