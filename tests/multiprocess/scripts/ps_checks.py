"""A parameter-server cluster: the chief trains through a ClusterCoordinator, checks the
results and writes them to OUT_DIR/ps.json; workers and ps tasks serve.

usage: ps_checks.py OUT_DIR MODE   (MODE: train | fit | error | kill-worker)
"""

import json
import os
import signal
import sys

import torch

import phalanx

out_dir, mode = sys.argv[1], sys.argv[2]
resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id).join()
    raise SystemExit(0)

strategy = phalanx.ParameterServerStrategy(resolver)
coordinator = phalanx.coordinator.ClusterCoordinator(strategy, worker_recovery_timeout=20)
result = {}

with strategy.scope():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    # momentum 0.5, not 0.9: asynchronous steps add momentum of their own (a gradient computed
    # before another worker's push lands); with 0.9 this model diverges once every push is one
    # write stale (NaN in a two-worker simulation), and how stale the pushes are depends on how
    # fast the chief hands out functions (the `train` check failed 7 of 15 times at 0.9 on a
    # loaded box with run calls on the data path, 0 of 15 on gRPC's slower ones; 2-4 writes
    # between a worker's read and its push against 1.6-1.7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
result["placement"] = sorted({h.ps for _, h in strategy._live()})
initial = {name: p.detach().clone() for name, p in model.named_parameters()}
held_out = torch.randn(256, 4, generator=torch.Generator().manual_seed(99))


def held_out_loss():
    """The model's loss on a fixed batch (BatchNorm in eval mode): a steadier measure of
    progress than the losses of the last asynchronous steps, which depend on interleaving."""
    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(held_out), held_out.sum(1, keepdim=True))
    model.train()
    return float(loss)


def dataset_fn(ctx):
    g = torch.Generator().manual_seed(ctx.input_pipeline_id)
    while True:
        x = torch.randn(16, 4, generator=g)
        yield x, x.sum(1, keepdim=True)


iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))


def step(iterator):
    x, y = next(iterator)

    def replica_fn(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    loss = strategy.run(replica_fn, args=(x, y))
    return {"loss": loss, "worker": strategy.worker_index, "pid": os.getpid()}


def fails(iterator):
    next(iterator)
    raise ValueError("a bad batch")


if mode == "train":
    result["held_out_before"] = held_out_loss()
    values = [coordinator.schedule(step, args=(iterator,)) for _ in range(80)]
    coordinator.join()
    result["held_out_after"] = held_out_loss()
    outputs = [v.fetch() for v in values]
    result["workers_used"] = sorted({o["worker"] for o in outputs})
    # named, so that a failure says which copy stayed as it was
    result["unchanged"] = [name for name, p in model.named_parameters() if torch.equal(initial[name], p)]
    result["running_mean_moved"] = bool(model[1].running_mean.abs().sum() > 0)
    result["num_batches_tracked"] = int(model[1].num_batches_tracked)
    # a write on the coordinator reaches the ps tasks before the next function runs
    with torch.no_grad():
        model[2].bias.fill_(123.0)
    seen = coordinator.schedule(lambda: model[2].bias[0].item())
    result["bias_seen_by_worker"] = seen.fetch()
elif mode == "fit":
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    y = (x.sum(1) > 0).long()
    with strategy.scope():
        torch.manual_seed(0)
        keras_model = phalanx.Model(
            torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        )
        keras_model.compile(
            optimizer="adam",
            loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = keras_model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    result["losses"] = history.history["loss"]
    result["accuracy"] = history.history["accuracy"]
    result["examples_counted"] = int(keras_model._loss_tracker.count)
elif mode == "error":
    failing = coordinator.schedule(fails, args=(iterator,))
    later = [coordinator.schedule(step, args=(iterator,)) for _ in range(3)]
    try:
        coordinator.join()
    except ValueError as exc:
        result["join_raised"] = str(exc)
    result["statuses"] = [v.status.value for v in [failing, *later]]
    result["usable_after"] = float(coordinator.schedule(step, args=(iterator,)).fetch()["loss"]) > 0
elif mode == "kill-worker":
    first = coordinator.schedule(step, args=(iterator,)).fetch()
    pids = {}
    while len(pids) < 2:
        o = coordinator.schedule(step, args=(iterator,)).fetch()
        pids[o["worker"]] = o["pid"]
    os.kill(pids[1], signal.SIGKILL)
    values = [coordinator.schedule(step, args=(iterator,)) for _ in range(20)]
    coordinator.join()
    result["finished"] = sum(v.status.value == "READY" for v in values)
    result["workers_after_kill"] = sorted({v.fetch()["worker"] for v in values})

with open(os.path.join(out_dir, "ps.json"), "w") as f:
    json.dump(result, f)
coordinator.shutdown()
