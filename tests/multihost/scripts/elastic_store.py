"""The rendezvous store of an elastic job on simulated hosts: a TCPStore that outlives every
worker (what `phalanx launch --min-workers` serves itself on one machine).

usage: elastic_store.py HOST PORT   (serves until killed)
"""

import sys
import time
from datetime import timedelta

import torch.distributed as dist

host, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore(host, port, None, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
print(f"serving at {host}:{port}", flush=True)
while True:
    time.sleep(3600)
