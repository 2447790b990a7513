"""Two MultiWorkerMirrored workers save with one CheckpointManager folder; each then asks for
the latest checkpoint at once. The chief is slow to write (its state_dict sleeps), so a
worker that did not wait for it would find nothing.

usage: latest_after_save.py CKPT_DIR OUT_DIR
"""

import json
import os
import sys
import time

from torch import nn

import phalanx
from phalanx.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint

ckpt_dir, out_dir = sys.argv[1], sys.argv[2]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index


class SlowOnTheChief:
    """State whose reading takes a second on the chief only: its files land late."""

    def state_dict(self):
        if strategy.is_chief:
            time.sleep(1.0)
        return {}

    def load_state_dict(self, state):
        pass


with strategy.scope():
    model = nn.Linear(2, 2)
manager = CheckpointManager(Checkpoint(model=model, slow=SlowOnTheChief()), ckpt_dir, max_to_keep=2)
seen = []
with strategy.scope():  # the chief writes, the others write to a temporary folder
    for _ in range(3):
        path = manager.save()
        seen.append(
            {"saved": path, "latest": latest_checkpoint(ckpt_dir), "manager": manager.latest_checkpoint}
        )
with open(os.path.join(out_dir, f"latest-{rank}.json"), "w") as f:
    json.dump(seen, f)
strategy.close()
