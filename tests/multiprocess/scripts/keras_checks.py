"""Under 2 workers: restore a OneDevice checkpoint, global metrics, predict order. Writes results.

usage: keras_checks.py CKPT_PATH OUT_DIR
"""

import json
import os
import sys

import torch
from torch import nn

import phalanx
from phalanx.checkpoint import Checkpoint

ckpt_path, out_dir = sys.argv[1], sys.argv[2]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
with strategy.scope():
    net = nn.Sequential(nn.Linear(4, 3))
    Checkpoint(model=net).read(ckpt_path)
    model = phalanx.Model(net)
    model.compile(
        "sgd", loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    metric = phalanx.metrics.SparseCategoricalAccuracy()
g = torch.Generator().manual_seed(0)
x, y = torch.randn(53, 4, generator=g), torch.randint(0, 3, (53,), generator=g)
predictions = model.predict(x, batch_size=8)
loss, accuracy = model.evaluate(x, y, batch_size=10, verbose=0)
for batch in strategy.experimental_distribute_dataset([(x[:25], y[:25])]):
    strategy.run(lambda a, b: metric.update_state(a, model(b)), args=(batch[1], batch[0]))
# fit's per-step logs: every metric state (loss total and count, accuracy total and count) in
# one cross-worker all-reduce, giving what reading each state on its own gives
one_by_one = {m.name: float(m.result()) for m in model.metrics}
calls = []
all_reduce = strategy.cross_worker_all_reduce
strategy.cross_worker_all_reduce = lambda *args, **kwargs: calls.append(1) or all_reduce(*args, **kwargs)
logs = model.get_metrics_result()
strategy.cross_worker_all_reduce = all_reduce
with open(os.path.join(out_dir, f"keras-{rank}.json"), "w") as f:
    json.dump(
        {
            "predictions": predictions.tolist(),
            "loss": loss,
            "accuracy": accuracy,
            "metric": float(metric.result()),
            "logs": logs,
            "one_by_one": one_by_one,
            "logs_collectives": len(calls),
            "weight": net.state_dict()["0.weight"].tolist(),
        },
        f,
    )
strategy.close()
