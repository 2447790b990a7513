"""The status page of a parameter-server job served by its chief (PHALANX_STATUS_ADDRESS on
every task): the chief schedules 60 training functions, then reads its own /status.json until
its closures and every worker and ps task show, and saves that view as OUT_DIR/ps.json.

usage: status_ps.py OUT_DIR
"""

import json
import os
import sys
import time
import urllib.request

import torch

import phalanx

out_dir = sys.argv[1]
resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
    raise SystemExit(0)

strategy = phalanx.ParameterServerStrategy(resolver)
coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def step():
    def replica_fn():
        x = torch.randn(8, 4)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    strategy.run(replica_fn)
    time.sleep(0.05)  # a second or more of closures: the rates are measured over a window


for _ in range(60):
    coordinator.schedule(step)
coordinator.join()


def complete(view):
    rows = {row["task"]: row for row in view["workers"]}
    ps = view["parameter_server"] or {"closures": {}}
    done = sum(c["done"] for c in ps["closures"].values())
    return done == 60 and {"chief:0", "worker:0", "worker:1", "ps:0"} <= set(rows)


url = f"http://{os.environ['PHALANX_STATUS_ADDRESS']}/status.json"
deadline, view = time.monotonic() + 60, None
while time.monotonic() < deadline:
    with urllib.request.urlopen(url, timeout=5) as answer:
        view = json.load(answer)
    if complete(view):
        break
    time.sleep(0.2)
with open(os.path.join(out_dir, "ps.json"), "w") as f:
    json.dump(view, f)
strategy.close()
