"""The TF1 article's between-graph replication: every worker runs this same program as its
own client; variables live on the ps tasks and are updated asynchronously; the chief
(worker 0) initialises them, writes checkpoints and TensorBoard summaries; a restarted
worker rejoins where the cluster is.

Run: phalanx launch --workers 2 --ps 1 examples/tf1_between_graph.py [--last-step N]
or start it once per task yourself (the ps tasks and every worker), each with TF_CONFIG naming
the task and one PHALANX_CLUSTER_TOKEN for the cluster:

    TF_CONFIG='{"cluster": {"worker": [...], "ps": [...]}, "task": {"type": "worker", "index": 1}}' \
        python examples/tf1_between_graph.py --checkpoint-dir /tmp/train_logs
"""

import argparse

import torch

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", default="/tmp/train_logs")
parser.add_argument("--last-step", type=int, default=400, help="stop at this global step")
args = parser.parse_args()

resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
cluster, job_name, task_index = resolver.cluster_spec(), resolver.task_type, resolver.task_id
if job_name == "ps":
    server = phalanx.train.Server(cluster, job_name="ps", task_index=task_index)
    server.join()  # serves the variables until the process is stopped
    raise SystemExit(0)

# TF1: with tf.device(tf.train.replica_device_setter(worker_device=..., cluster=cluster)):
strategy = phalanx.train.replica_device_setter(cluster, worker_device=f"/job:worker/task:{task_index}")
with strategy.scope():  # every worker builds the same model; it lives on the ps tasks
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

generator = torch.Generator().manual_seed(task_index)  # each worker reads its own data
true_w = torch.tensor([[2.0], [-3.0], [0.5]])


def train_step(x):
    loss = (model(x) - x @ true_w).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # asynchronous: the ps tasks apply this worker's gradients at once
    return {"loss": loss.detach()}


hooks = [phalanx.train.StopAtStepHook(last_step=args.last_step)]
with phalanx.train.MonitoredTrainingSession(
    strategy,
    is_chief=(task_index == 0),  # initialises the variables, saves checkpoints and summaries
    checkpoint_dir=args.checkpoint_dir,
    hooks=hooks,
    save_checkpoint_steps=50,
    save_summaries_steps=10,
) as sess:
    print(f"worker:{task_index} starts at global step {sess.global_step}", flush=True)
    steps, loss = 0, float("nan")  # a worker (re)started after the last step takes none
    while not sess.should_stop():
        loss = float(sess.run(train_step, torch.randn(32, 3, generator=generator))["loss"])
        steps += 1
    print(f"worker:{task_index} took {steps} steps; global step {sess.global_step}; loss {loss:.4f}")
