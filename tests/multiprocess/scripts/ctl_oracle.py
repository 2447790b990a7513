"""The tf.distribute custom loop under MultiWorkerMirroredStrategy; writes its results to OUT_DIR.

usage: ctl_oracle.py OUT_DIR [LOCAL_REPLICAS] [N_EXAMPLES] [DEVICE_TYPE]

DEVICE_TYPE "cuda" puts every worker's replicas on the GPU(s) and communicates over gloo
(RING), so that two workers can share one GPU.
"""

import json
import os
import sys

import torch

import phalanx
from support import oracle

out_dir = sys.argv[1]
local = int(sys.argv[2]) if len(sys.argv) > 2 else 1
n = int(sys.argv[3]) if len(sys.argv) > 3 else 256
kind = sys.argv[4] if len(sys.argv) > 4 else "cpu"
if kind == "cuda":
    torch.backends.cuda.matmul.allow_tf32 = False
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(local)]
    options = phalanx.CommunicationOptions(implementation="RING")
else:
    devices, options = [f"cpu:{i}" for i in range(local)], None
strategy = phalanx.MultiWorkerMirroredStrategy(communication_options=options, devices=devices)
losses, state, seen = oracle.run_ctl(strategy, n=n)
rank = strategy.cluster_resolver.worker_index
torch.save({"state": {k: v.cpu() for k, v in state.items()}}, os.path.join(out_dir, f"state-{rank}.pt"))
with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
    json.dump(
        {
            "losses": losses.tolist(),
            "seen": seen,
            "replicas": strategy.num_replicas_in_sync,
            "plain_parameters": len(strategy._plain),
            "buckets": strategy._buckets is not None,
        },
        f,
    )
print("done", rank, strategy.num_replicas_in_sync)
strategy.close()
