"""Model.evaluate or Model.predict called on their own under an elastic MultiWorkerMirroredStrategy
(phalanx launch --min-workers); a chosen worker SIGKILLs itself in the 4th batch of the pass.

usage: elastic_evaluate.py OUT_DIR KILL_RANK WHAT

WHAT: "evaluate" or "predict" (240 examples, a global batch of 24: 10 batches). KILL_RANK < 0:
nobody dies. Every worker that finishes writes OUT_DIR/result-<rank>-<incarnation>.pt: the
pass's result, the callback events it saw, the run count and the number of workers.
"""

import os
import signal
import sys

import torch
from torch import nn

import phalanx

out_dir, kill_rank, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = int(os.environ.get("RANK", strategy.cluster_resolver.task_id or 0))
incarnation = int(os.environ.get("PHALANX_ELASTIC_INCARNATION", "0"))
dies = rank == kill_rank and incarnation == 0

g = torch.Generator().manual_seed(1)
x = torch.randn(240, 6, generator=g)
y = torch.randint(0, 3, (240,), generator=g)


class Dying(phalanx.Model):
    """The killer SIGKILLs itself in the 4th batch of the pass (the others wait in that batch)."""

    batches = 0

    def _count(self) -> None:
        Dying.batches += 1
        if dies and Dying.batches == 4:
            print(f"worker {rank} kills itself in the 4th batch of {what}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def test_step(self, data):
        self._count()
        return super().test_step(data)

    def predict_step(self, data):
        self._count()
        return super().predict_step(data)


class Events(phalanx.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_test_begin(self, logs=None):
        self.events.append("test_begin")

    def on_test_batch_begin(self, batch, logs=None):
        self.events.append(f"begin {batch}")

    def on_test_batch_end(self, batch, logs=None):
        self.events.append(f"end {batch}")

    def on_test_end(self, logs=None):
        self.events.append("test_end")

    def on_predict_begin(self, logs=None):
        self.events.append("predict_begin")

    def on_predict_batch_begin(self, batch, logs=None):
        self.events.append(f"begin {batch}")

    def on_predict_batch_end(self, batch, logs=None):
        self.events.append(f"end {batch}")

    def on_predict_end(self, logs=None):
        self.events.append("predict_end")


torch.manual_seed(0)
with strategy.scope():
    model = Dying(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 3)))
    model.compile(
        optimizer="adam",
        loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
events = Events()
if what == "evaluate":
    result = model.evaluate(x, y, batch_size=24, verbose=0, callbacks=[events], return_dict=True)
else:
    result = model.predict(x, batch_size=24, verbose=0, callbacks=[events])
torch.save(
    {
        "result": result,
        "events": events.events,
        "run_count": strategy.run_count,
        "workers": strategy.num_workers_in_sync,
    },
    os.path.join(out_dir, f"result-{rank}-{incarnation}.pt"),
)
strategy.close()
