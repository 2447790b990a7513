"""A MultiWorkerMirrored fit inside Ray Train's TorchTrainer (2 CPU workers), run unchanged, and
a parameter-server job on Ray actors.

usage: ray_train_fit.py WORK_DIR

The driver trains the same model on one device (the reference), then under Ray twice on one
local Ray cluster: uninterrupted, and with worker 1 SIGKILLed mid-epoch once under
``FailureConfig(max_failures=1)`` (Ray restarts the group; BackupAndRestore resumes it).
Each writes its weights to WORK_DIR: one_device.pt, ray.pt, ray_killed.pt. Last, on the same
Ray cluster, examples/parameter_server_training.py runs as one Ray actor per task (chief, 2
workers, 1 ps), each given a TF_CONFIG built from the actors' addresses; the chief's output
goes to WORK_DIR/ps_chief.txt.
"""

import contextlib
import io
import json
import os
import runpy
import signal
import socket
import sys
from pathlib import Path

import torch
from torch import nn

import phalanx

EPOCHS, BATCH = 3, 16


def fit(strategy, backup_dir=None, kill_marker=None):
    """The model after EPOCHS epochs of adam on fixed data (global batch BATCH, no shuffling)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    with strategy.scope():
        model = phalanx.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
        model.compile(optimizer="adam", loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [] if backup_dir is None else [phalanx.callbacks.BackupAndRestore(backup_dir)]
    if kill_marker is not None:
        resolver = strategy.cluster_resolver
        last = resolver.task_id == resolver.cluster_spec().num_tasks("worker") - 1
        callbacks.append(KillOnce(kill_marker, last))
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    return model


class KillOnce(phalanx.callbacks.Callback):
    """SIGKILLs the last worker at epoch 1, batch 2, the first time only (a marker file)."""

    def __init__(self, marker, last):
        super().__init__()
        self.marker, self.last = marker, last

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.last and (self.epoch, batch) == (1, 2) and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def train_func(config):
    """Ray's training function: the phalanx program, unchanged (every Ray worker)."""
    strategy = phalanx.MultiWorkerMirroredStrategy()
    print(f"ray worker {strategy.cluster_resolver.task_id}: {type(strategy.cluster_resolver).__name__}")
    model = fit(strategy, config["backup"], config.get("marker"))
    if strategy.is_chief:
        torch.save(model.module.state_dict(), config["out"])


PS_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "parameter_server_training.py"


class PhalanxTask:
    """One task of a phalanx cluster in a Ray actor: its address, then the program under its TF_CONFIG."""

    def address(self):
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:  # a free port of this node, for this task's server
            probe.bind((host, 0))
            return f"{host}:{probe.getsockname()[1]}"

    def run(self, tf_config, argv):
        os.environ["TF_CONFIG"] = json.dumps(tf_config)
        sys.argv = [str(PS_EXAMPLE), *argv]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(PS_EXAMPLE), run_name="__main__")  # ps and workers serve until killed
        return out.getvalue()


def parameter_server_on_actors(work):
    """The parameter-server example as Ray actors, one per task (the chief's output to ps_chief.txt)."""
    import ray

    actor = ray.remote(num_cpus=0.5)(PhalanxTask)
    roles = [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]
    tasks = [actor.remote() for _ in roles]
    addresses = ray.get([t.address.remote() for t in tasks])
    cluster = {}
    for (job, _), address in zip(roles, addresses, strict=True):
        cluster.setdefault(job, []).append(address)
    runs = [
        t.run.remote({"cluster": cluster, "task": {"type": job, "index": i}}, ["--epochs", "2"])
        for t, (job, i) in zip(tasks, roles, strict=True)
    ]
    try:
        output = ray.get(runs[0], timeout=240)  # the chief; the others serve it
    finally:
        for t in tasks:
            ray.kill(t)
    Path(work, "ps_chief.txt").write_text(output)
    print("ps: done", flush=True)


def main(work):
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    torch.save(fit(phalanx.OneDeviceStrategy("cpu")).module.state_dict(), os.path.join(work, "one_device.pt"))
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)
    try:
        runs = {"ray": (None, 0), "ray_killed": (os.path.join(work, "killed-once"), 1)}
        for name, (marker, failures) in runs.items():
            config = {"backup": os.path.join(work, f"backup-{name}"), "out": os.path.join(work, f"{name}.pt")}
            if marker is not None:
                config["marker"] = marker
            trainer = TorchTrainer(
                train_func,
                train_loop_config=config,
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(
                    name=name,
                    storage_path=os.path.join(work, "ray"),
                    failure_config=FailureConfig(max_failures=failures),
                ),
            )
            trainer.fit()
            print(f"{name}: done", flush=True)
        parameter_server_on_actors(work)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
