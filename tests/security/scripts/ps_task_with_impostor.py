"""One task of a parameter-server cluster where another process holds one task's address.

The task named by IMPOSTOR_TASK ("worker-0" or "ps-0") exits at once: the test's impostor
listens at its address. The other worker and ps tasks serve; the chief builds a model,
schedules one function and fetches its result, then prints ``chief error: <type>: <message>``
and exits 3 if anything raised, or ``chief done`` and exits 0.

usage: ps_task_with_impostor.py IMPOSTOR_TASK
"""

import sys

import torch

import phalanx

impostor = sys.argv[1]
resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
if f"{resolver.task_type}-{resolver.task_id}" == impostor:
    raise SystemExit(0)
if resolver.task_type in ("worker", "ps"):
    phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
    raise SystemExit(0)

try:
    strategy = phalanx.ParameterServerStrategy(resolver)
    coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
    result = coordinator.schedule(lambda: strategy.run(lambda: model(torch.ones(1, 2)).sum().detach()))
    coordinator.join()
    print("chief done:", float(result.fetch()), flush=True)
except Exception as exc:
    print(f"chief error: {type(exc).__name__}: {exc}", flush=True)
    raise SystemExit(3) from None
