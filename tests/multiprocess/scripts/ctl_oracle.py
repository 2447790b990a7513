"""The tf.distribute custom loop under MultiWorkerMirroredStrategy; writes its results to OUT_DIR.

usage: ctl_oracle.py OUT_DIR [LOCAL_REPLICAS] [N_EXAMPLES]
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
strategy = phalanx.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(local)])
losses, state, seen = oracle.run_ctl(strategy, n=n)
rank = strategy.cluster_resolver.worker_index
torch.save({"state": state}, os.path.join(out_dir, f"state-{rank}.pt"))
with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
    json.dump({"losses": losses.tolist(), "seen": seen, "replicas": strategy.num_replicas_in_sync}, f)
print("done", rank, strategy.num_replicas_in_sync)
strategy.close()
