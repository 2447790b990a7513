"""The custom training loop of the TF reference trajectories under MultiWorkerMirroredStrategy.

Writes OUT_DIR/result-<rank>.json (losses, example indices per step, replicas, the host name,
whether shared memory was used) and OUT_DIR/state-<rank>.pt (the final weights).

usage: ctl_oracle.py OUT_DIR [N_EXAMPLES]
"""

import json
import os
import socket
import sys

import torch

import phalanx
from support import oracle

out_dir = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 256
strategy = phalanx.MultiWorkerMirroredStrategy()
losses, state, seen = oracle.run_ctl(strategy, n=n)
rank = strategy.cluster_resolver.worker_index
torch.save({"state": dict(state)}, os.path.join(out_dir, f"state-{rank}.pt"))
with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
    json.dump(
        {
            "losses": losses.tolist(),
            "seen": seen,
            "replicas": strategy.num_replicas_in_sync,
            "hostname": socket.gethostname(),
            "shared_memory": strategy._group.uses_shared_memory,
            "tls": strategy._group.uses_tls,
            "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
        },
        f,
    )
print("done", rank, strategy.num_replicas_in_sync, flush=True)
strategy.close()
