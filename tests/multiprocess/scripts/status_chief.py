"""The status page served by the chief (PHALANX_STATUS_ADDRESS set on every task, no launcher
serving: a job started by torchrun, Ray, SLURM or Kubernetes). Both workers step 10 times;
the chief reads its own /status.json until both show running at step 10 (the other worker
waits in step 11's collective meanwhile, its reporter thread still reporting) and saves it;
after 10 more steps and close() it saves the view once both are done.

usage: status_chief.py OUT_DIR
"""

import json
import os
import sys
import time
import urllib.request

import torch

import phalanx

out_dir = sys.argv[1]
strategy = phalanx.MultiWorkerMirroredStrategy()
url = f"http://{os.environ['PHALANX_STATUS_ADDRESS']}/status.json"

with strategy.scope():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step():
    loss = model(torch.ones(2, 4)).square().sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def view_when(ok, name):
    deadline, view = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as answer:
            view = json.load(answer)
        if ok({row["task"]: row for row in view["workers"]}):
            break
        time.sleep(0.2)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(view, f)


for _ in range(10):
    strategy.run(step)
if strategy.cluster_resolver.task_id == 0:
    view_when(
        lambda rows: (
            all(r["state"] == "running" and r["step"] >= 10 for r in rows.values()) and len(rows) == 2
        ),
        "running.json",
    )
for _ in range(10):
    strategy.run(step)
strategy.close()
if strategy.cluster_resolver.task_id == 0:
    view_when(lambda rows: all(r["state"] == "done" for r in rows.values()) and len(rows) == 2, "done.json")
