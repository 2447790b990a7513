"""The coordinator's deadlines on a real cluster (chief, 2 workers, 1 ps): the chief runs
each case and writes what it saw to OUT_DIR/deadlines.json; the ps writes its pid there.

usage: ps_deadlines.py OUT_DIR
"""

import json
import os
import signal
import sys
import time

import torch

import phalanx

out_dir = sys.argv[1]
resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    if resolver.task_type == "ps":
        with open(os.path.join(out_dir, "ps.pid"), "w") as f:
            f.write(str(os.getpid()))
    phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
    raise SystemExit(0)

strategy = phalanx.ParameterServerStrategy(resolver)
# closure deadline 4 s; join()/fetch() without a timeout give up after 2 s without progress
coordinator = phalanx.coordinator.ClusterCoordinator(strategy, closure_timeout=4, wait_timeout=2)
result = {}


def sleeper(seconds):
    time.sleep(seconds)
    return strategy.worker_index


def failing():
    raise ValueError("the function's own error")


def timed(fn):
    """(error as 'Type: message' or None, seconds) of fn()."""
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return None, time.monotonic() - started


# fetch() with no timeout of its own: bounded by wait_timeout while nothing finishes
value = coordinator.schedule(sleeper, args=(3.0,))
result["fetch_stall"] = timed(value.fetch)
coordinator.join(timeout=30)

# join(timeout=...) names what is pending
coordinator.schedule(sleeper, args=(1.5,))
result["join_timeout"] = timed(lambda: coordinator.join(timeout=0.3))
coordinator.join(timeout=30)

# a function that hangs on a worker that answers heartbeats fails after the closure deadline
hung = coordinator.schedule(sleeper, args=(8.0,))
result["hung"] = timed(lambda: coordinator.join(timeout=30))
result["hung_fetch"] = timed(lambda: hung.fetch(timeout=1))
# the other worker serves meanwhile; the hung one again once its function returned
result["while_hung"] = sorted(
    {coordinator.schedule(sleeper, args=(0.0,)).fetch(timeout=30) for _ in range(4)}
)
time.sleep(8.0)
values = [coordinator.schedule(sleeper, args=(0.3,)) for _ in range(8)]
coordinator.join(timeout=60)
result["after"] = sorted({v.fetch() for v in values})

# join()'s first error is the one raised, even when the ps task hangs (SIGSTOP) meanwhile
with strategy.scope():
    model = torch.nn.Linear(2, 1)
coordinator.schedule(lambda: model(torch.ones(1, 2)).sum().item())
coordinator.join(timeout=30)  # the copies are now stale: join() would refresh them
with open(os.path.join(out_dir, "ps.pid")) as f:
    ps_pid = int(f.read())
coordinator.schedule(failing)
os.kill(ps_pid, signal.SIGSTOP)
try:
    result["first_error"] = timed(lambda: coordinator.join(timeout=30))
finally:
    os.kill(ps_pid, signal.SIGCONT)

with open(os.path.join(out_dir, "deadlines.json"), "w") as f:
    json.dump(result, f)
coordinator.shutdown()
strategy.close()
