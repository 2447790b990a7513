"""Worker 0 waits for a worker 1 that never starts; it must fail naming it."""

import sys

import phalanx

if phalanx.cluster.resolve_cluster().worker_index == 1:
    sys.exit(0)  # exits at once without joining
phalanx.MultiWorkerMirroredStrategy(join_timeout=2)
