"""ParameterServer training across simulated hosts, for the partition tests: every task runs
this; the chief trains in rounds and prints what the test waits for.

The chief prints ``STEPPING`` once training runs, ``LOST <indices>`` when the coordinator
counts a worker lost, ``BACK`` when every worker serves again, and at the end one line
``RESULT <json>``; in ps-cut mode a failed round prints ``ERROR <time.time()> <Type>: <msg>``.

usage: ps_across_hosts.py MODE   (MODE: worker-cut | ps-cut)
"""

import json
import sys
import time

import torch

import phalanx

mode = sys.argv[1]
resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
    raise SystemExit(0)

BATCH, ROUND = 8, 10
strategy = phalanx.ParameterServerStrategy(resolver)
coordinator = phalanx.coordinator.ClusterCoordinator(strategy, worker_recovery_timeout=120)
with strategy.scope():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_metric = phalanx.metrics.Mean(name="loss")


def dataset_fn(ctx):
    g = torch.Generator().manual_seed(ctx.input_pipeline_id)
    while True:
        x = torch.randn(BATCH, 4, generator=g)
        yield x, x.sum(1, keepdim=True)


iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))


def step(iterator):
    x, y = next(iterator)

    def replica_fn(x, y):
        per_example = ((model(x) - y) ** 2).mean(1)
        optimizer.zero_grad()
        per_example.mean().backward()
        optimizer.step()
        loss_metric.update_state(per_example.detach())  # one count per example

    strategy.run(replica_fn, args=(x, y))
    time.sleep(0.02)  # a step long enough that a cut falls inside one
    return strategy.worker_index


def train_round():
    values = [coordinator.schedule(step, args=(iterator,)) for _ in range(ROUND)]
    coordinator.join()
    return [v.fetch() for v in values]


def train_through_a_worker_cut():
    rounds, phase, used_after = 0, "before", set()
    while True:
        workers = train_round()
        rounds += 1
        if rounds == 2:
            print("STEPPING", flush=True)
        if phase == "after":  # rounds that started once every worker served again
            used_after.update(workers)
            if used_after == {0, 1}:  # the healed worker trains again
                break
        lost = sorted(coordinator._lost)
        if phase == "before" and lost:
            print(f"LOST {lost}", flush=True)
            phase = "lost"
        elif phase == "lost" and not lost:
            print("BACK", flush=True)
            phase = "after"
        if rounds > 400:
            raise SystemExit(f"the partition never healed (phase {phase})")
    return {"steps": rounds * ROUND, "examples": int(loss_metric.count), "used_after": sorted(used_after)}


def train_through_a_ps_cut():
    for rounds in range(1, 400):
        try:
            train_round()
        except Exception as exc:  # the test checks what it is and when it came
            print(f"ERROR {time.time()} {type(exc).__name__}: {exc}", flush=True)
            return {"rounds": rounds}
        if rounds == 2:
            print("STEPPING", flush=True)
    raise SystemExit("no step failed")


result = train_through_a_worker_cut() if mode == "worker-cut" else train_through_a_ps_cut()
print(f"RESULT {json.dumps(result)}", flush=True)
coordinator.shutdown()
strategy.close()
