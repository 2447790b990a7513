"""A MultiWorkerMirrored worker that all-reduces once; worker 1 may hold another token.

With ``other`` as argument, worker 1 replaces PHALANX_CLUSTER_TOKEN with a secret of its own
before it joins: it plays a process that reaches the chief's rendezvous port without the
cluster's token. Each worker prints ``sum <value>`` or ``error <type>: <message>`` (exit 3).

usage: mwms_with_token.py same|other
"""

import os
import sys

import torch

import phalanx

resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
if sys.argv[1] == "other" and resolver.task_id == 1:
    os.environ["PHALANX_CLUSTER_TOKEN"] = "not-the-cluster-secret-0123456789"
try:
    strategy = phalanx.MultiWorkerMirroredStrategy(resolver)
    value = strategy.run(lambda: torch.tensor(float(resolver.task_id + 1)))
    print("sum", float(strategy.reduce(phalanx.ReduceOp.SUM, value, axis=None)), flush=True)
except Exception as exc:
    print(f"error {type(exc).__name__}: {exc}", flush=True)
    raise SystemExit(3) from None
