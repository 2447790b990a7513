"""The worker group of MultiWorkerMirrored, its subgroups and the phalanx c10d backend."""
