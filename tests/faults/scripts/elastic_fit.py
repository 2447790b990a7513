"""Model.fit with BackupAndRestore under an elastic MultiWorkerMirroredStrategy (phalanx launch
--min-workers); chosen workers SIGKILL themselves, each once.

usage: elastic_fit.py OUT_DIR EPOCHS KILL_RANKS KILL_AT [PAUSE] [VALIDATE]

KILL_RANKS and KILL_AT are comma-separated lists of the same length: worker KILL_RANKS[i] (its
first incarnation) dies at KILL_AT[i]:
  N       at the start of training step N (the others wait in that step);
  vN      in the 4th validation batch after N training steps (the others wait in that
          validation step; needs VALIDATE=1);
  start   before it makes its strategy (it never joins);
  join    in the first group's check-in, after the membership counted it in (the others wait
          there).

VALIDATE=1: fit validates on 240 more examples after every epoch (10 batches).

KILL_RANKS < 0: nobody kills itself (the chaos test kills from outside). Every worker writes
OUT_DIR/weights-<rank>-<incarnation>.pt (its final weights and the wall times of its steps)
and OUT_DIR/pid-<rank>-<incarnation>; a killer writes OUT_DIR/killed-at-<rank> (the wall time
just before its SIGKILL).
"""

import os
import signal
import sys
import time

import torch
from torch import nn

import phalanx
from phalanx.communication.membership import rendezvous

out_dir, epochs = sys.argv[1], int(sys.argv[2])
kills = dict(zip(map(int, sys.argv[3].split(",")), sys.argv[4].split(","), strict=True))
kills = {rank: when for rank, when in kills.items() if rank >= 0}
pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
validate = len(sys.argv) > 6 and sys.argv[6] == "1"
incarnation = int(os.environ.get("PHALANX_ELASTIC_INCARNATION", "0"))
# this worker's death: "start", "join", "<step>" or "v<step>"; None: it lives
kill_when = kills.get(int(os.environ.get("RANK", "-1"))) if incarnation == 0 else None


def _kill(where: str) -> None:
    with open(os.path.join(out_dir, f"killed-at-{os.environ.get('RANK')}"), "w") as f:
        f.write(repr(time.time()))
    print(f"worker {os.environ.get('RANK')} kills itself {where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if kill_when == "start":
    _kill("before it joins")
if kill_when == "join":
    rendezvous.Rendezvous.check_in = lambda *args, **kwargs: _kill("in the first group's check-in")
train_kill = int(kill_when) if kill_when and kill_when.isdigit() else None
validation_kill = int(kill_when[1:]) if kill_when and kill_when.startswith("v") else None
strategy = phalanx.MultiWorkerMirroredStrategy()
rank = int(os.environ.get("RANK", strategy.cluster_resolver.task_id or 0))  # TF_CONFIG alone: its index
with open(os.path.join(out_dir, f"pid-{rank}-{incarnation}"), "w") as f:
    f.write(str(os.getpid()))

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(1200, 6, generator=g)
y = torch.randint(0, 3, (1200,), generator=g)
validation = (torch.randn(240, 6, generator=g), torch.randint(0, 3, (240,), generator=g))


class Validated(phalanx.Model):
    """A "v<N>" killer SIGKILLs itself in the 4th batch of the validation pass after N steps."""

    val_batches = 0

    def test_step(self, data):
        if steps.done == validation_kill:
            Validated.val_batches += 1
            if Validated.val_batches == 4:
                _kill("in a validation pass")
        return super().test_step(data)


with strategy.scope():
    model = Validated(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    model.compile(
        optimizer="adam",
        loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


class Steps(phalanx.callbacks.Callback):
    """Records each step's wall time; a "<N>" killer SIGKILLs itself at the start of step N."""

    def __init__(self):
        super().__init__()
        self.times, self.done = [], 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.done == train_kill:
            _kill("in a training step")  # the others wait in the step

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        self.times.append(time.time())
        if pause:
            time.sleep(pause)


steps = Steps()
backup = phalanx.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=5)
history = model.fit(
    x,
    y,
    batch_size=24,
    epochs=epochs,
    shuffle=True,
    verbose=0,
    callbacks=[backup, steps],
    validation_data=validation if validate else None,
)
torch.save(
    {
        "weights": model.module.state_dict(),
        "times": steps.times,
        "run_count": strategy.run_count,
        "workers": strategy.num_workers_in_sync,
        "val_loss": history.history.get("val_loss", []),
        "shared_memory": strategy._group is not None and strategy._group.uses_shared_memory,  # the last group
        "tls": strategy._group is not None and strategy._group.uses_tls,
    },
    os.path.join(out_dir, f"weights-{rank}-{incarnation}.pt"),
)
strategy.close()
