"""Worker 1 is late; worker 0's all_reduce with a 1 s per-call timeout fails, naming the wait."""

import sys
import time

import torch

import phalanx
from phalanx.communication.group.worker_group import PeerUnavailableError

strategy = phalanx.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.worker_index
options = phalanx.CommunicationOptions(timeout_seconds=1)
if rank == 1:
    time.sleep(4)
try:
    strategy.run(lambda: phalanx.get_replica_context().all_reduce("sum", torch.ones(1), options))
except PeerUnavailableError as exc:
    print("timed out:", exc)
    sys.exit(7 if rank == 0 else 0)
