"""BackupAndRestore(save_before_preemption=True) in one process: a real SIGTERM mid-epoch backs
up after that batch and exits with 42 (SystemExit here); the restarted fit ends with the
uninterrupted weights."""

import os
import signal

import pytest
import torch
from torch import nn

import phalanx
from phalanx.callbacks import BackupAndRestore, Callback
from support.strategies import IN_PROCESS


class SigtermAt(Callback):
    """Sends SIGTERM to this process at the end of global batch ``at`` (on the first run only)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(name, backup_dir, sigterm_at=None):
    strategy = IN_PROCESS[name]()  # a fresh one: its run count keys dropout, as in a new process
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    with strategy.scope():
        model = phalanx.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)))
        model.compile(optimizer="adam", loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [SigtermAt(sigterm_at), BackupAndRestore(str(backup_dir), save_before_preemption=True)]
    model.fit(x, y, batch_size=16, epochs=3, shuffle=True, verbose=0, callbacks=callbacks)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


@pytest.mark.parametrize("name", ["one_device", "mirrored_2cpu"])
def test_sigterm_backs_up_exits_42_and_the_restarted_fit_matches(tmp_path, name):
    before = signal.getsignal(signal.SIGTERM)
    expected = _fit(name, tmp_path / "reference")
    assert signal.getsignal(signal.SIGTERM) is before  # given back at the end of fit
    with pytest.raises(SystemExit) as exited:
        _fit(name, tmp_path / "run", sigterm_at=6)  # batch 1 of epoch 1
    assert exited.value.code == 42
    assert signal.getsignal(signal.SIGTERM) is before
    assert (tmp_path / "run" / "backup.pt").exists()
    got = _fit(name, tmp_path / "run")
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert not (tmp_path / "run").exists()  # a completed fit removes its backup
