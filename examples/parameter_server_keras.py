"""TF's parameter-server tutorial, Model.fit part, ported: a chief coordinates Model.fit, workers
train asynchronously, a ps task holds the variables; a sidecar evaluator process evaluates each
checkpoint the chief writes.

Run: phalanx launch --chief --workers 2 --ps 1 examples/parameter_server_keras.py [--epochs N]
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
from sklearn.datasets import load_digits
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--checkpoint-dir", default=None)
parser.add_argument("--sidecar", action="store_true", help="run as the evaluator (started by the chief)")
args = parser.parse_args()

digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
y = digits.target.astype(np.int64)


def build_model():
    model = phalanx.Model(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    model.compile(
        optimizer="adam",
        loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


if args.sidecar:
    # The evaluator task: evaluates each new checkpoint until none came for 10 s.
    evaluator = phalanx.SidecarEvaluator(
        build_model(), data=(x, y), checkpoint_dir=args.checkpoint_dir, timeout_seconds=10, poll_seconds=0.2
    )
    results = evaluator.start()
    print(f"sidecar evaluated {len(results)} checkpoint(s); last accuracy {results[-1]['accuracy']:.3f}")
    raise SystemExit(0)

resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    server = phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id)
    server.join()  # until the launcher stops the task, once the chief is done
    raise SystemExit(0)

strategy = phalanx.ParameterServerStrategy(resolver)
checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="phalanx-ps-keras-")
env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}  # the evaluator is not a training task
sidecar = subprocess.Popen(
    [sys.executable, __file__, "--sidecar", "--checkpoint-dir", checkpoint_dir], env=env
)

with strategy.scope():
    model = build_model()
manager = phalanx.checkpoint.CheckpointManager(
    phalanx.checkpoint.Checkpoint(model=model), checkpoint_dir, max_to_keep=3
)
save_each_epoch = phalanx.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: manager.save())
model.fit(x, y, batch_size=64, epochs=args.epochs, callbacks=[save_each_epoch], verbose=2)
loss, accuracy = model.evaluate(x, y, verbose=0)  # inline evaluation, on the coordinator
print(f"inline evaluation: accuracy {accuracy:.3f}")
raise SystemExit(sidecar.wait(timeout=300))
