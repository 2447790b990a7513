"""SyncBatchNorm across 2 workers x 1 replica: writes outputs and running stats."""

import json
import os
import sys

import torch

import phalanx

out_dir = sys.argv[1]
# RING (gloo) lets two workers share one GPU, which NCCL refuses.
options = phalanx.CommunicationOptions(implementation=os.environ.get("PHALANX_TEST_IMPLEMENTATION", "AUTO"))
strategy = phalanx.MultiWorkerMirroredStrategy(communication_options=options)
rank = strategy.cluster_resolver.worker_index
with strategy.scope():
    bn = phalanx.nn.SyncBatchNorm(3)
x = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3) ** 1.5
torch.backends.cuda.matmul.allow_tf32 = False
(batch,) = list(strategy.experimental_distribute_dataset([x]))
out = strategy.gather(strategy.run(bn, args=(batch,)), axis=0)
with open(os.path.join(out_dir, f"bn-{rank}.json"), "w") as f:
    json.dump(
        {
            "out": out.cpu().tolist(),
            "mean": bn.running_mean.cpu().tolist(),
            "var": bn.running_var.cpu().tolist(),
        },
        f,
    )
strategy.close()
