"""MultiWorkerMirrored training over a transport the program registers itself
(`store_transport.py`): a few custom-loop steps of a small MLP, then the weights and how many
collectives the transport carried go to ``transport-<rank>.json`` in OUT_DIR.

usage: transport_training.py OUT_DIR
"""

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import store_transport  # noqa: E402

import phalanx  # noqa: E402
from phalanx.communication.transports import registry  # noqa: E402

registry.register("store", store_transport.open_store_transport, first=True)  # the one line

out_dir = sys.argv[1]
strategy = phalanx.MultiWorkerMirroredStrategy()
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(1)
features = torch.randn(64, 8, generator=generator)
labels = torch.randint(0, 3, (64,), generator=generator)
batches = phalanx.data.Dataset.from_tensor_slices((features, labels)).batch(16)


def step(x, y):
    loss = phalanx.compute_average_loss(nn.functional.cross_entropy(model(x), y, reduction="none"))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


losses = [
    strategy.reduce("sum", strategy.run(step, args=batch), axis=None).item()
    for batch in strategy.experimental_distribute_dataset(batches)
]
rank = strategy.cluster_resolver.worker_index
result = {
    "transport": strategy._group.transport_name,
    "calls": store_transport.calls,
    "losses": losses,
    "weights": {k: v.tolist() for k, v in model.state_dict().items()},
}
with open(os.path.join(out_dir, f"transport-{rank}.json"), "w") as f:
    json.dump(result, f)
