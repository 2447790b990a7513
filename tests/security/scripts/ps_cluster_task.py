"""One task of a parameter-server cluster (chief, worker or ps), for per-node `phalanx launch`.

Worker and ps tasks serve until they are stopped; the chief runs a few steps and exits with
the code given. Every task writes its pid to OUT_DIR/<type>-<index>.pid first.

usage: ps_cluster_task.py OUT_DIR CHIEF_EXIT_CODE
"""

import os
import sys

import torch

import phalanx

out_dir, chief_code = sys.argv[1], int(sys.argv[2])
resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
with open(os.path.join(out_dir, f"{resolver.task_type}-{resolver.task_id}.pid"), "w") as f:
    f.write(str(os.getpid()))
if resolver.task_type in ("worker", "ps"):
    phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
    raise SystemExit(0)

strategy = phalanx.ParameterServerStrategy(resolver)
coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    model = torch.nn.Linear(2, 1)


def step():
    return strategy.run(lambda: model(torch.ones(1, 2)).sum().detach())


results = [coordinator.schedule(step) for _ in range(3)]
coordinator.join()
print("chief done:", [float(r.fetch()) for r in results], flush=True)
sys.exit(chief_code)
