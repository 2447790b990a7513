"""torchrun's own restarts: ``--max-restarts 1`` with the c10d rendezvous. One worker is SIGKILLed
mid-epoch; torchrun's agent stops the other, starts both again (``TORCHELASTIC_RESTART_COUNT=1``,
on the same agent store, where phalanx keeps each restart's keys apart), and BackupAndRestore
resumes the fit from its last backup to the weights of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.cluster import free_ports, run_python

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent / "scripts" / "fit_with_backup.py"


def _torchrun(folder: Path, kill: tuple[str, str]):
    """The fit under torchrun (2 processes, c10d rendezvous, one restart allowed)."""
    folder.mkdir()
    port = free_ports(1)[0]
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    args = [folder / "backup", folder / "final.pt", "epoch", *kill, "multi_worker"]
    launch = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1"]
    done = run_python(*launch, *rendezvous, SCRIPT, *args, timeout=300)
    return done, folder / "final.pt"


def test_a_worker_killed_under_torchrun_max_restarts_resumes_to_the_uninterrupted_weights(tmp_path):
    reference, ref_out = _torchrun(tmp_path / "ref", ("-1", "-1"))
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-6000:]
    killed, out = _torchrun(tmp_path / "run", ("2", "4"))  # epoch 3 of 4, mid-epoch, once
    output = killed.stdout + killed.stderr
    assert killed.returncode == 0, output[-8000:]
    assert (tmp_path / "run" / "killed-once").exists()  # the kill happened
    assert "failed (exitcode: -9) local_rank: 1" in output, output[-8000:]  # torchrun saw it, restarted
    expected, got = torch.load(ref_out), torch.load(out)
    for key, value in expected["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert not (tmp_path / "run" / "backup").exists()  # deleted after the completed fit
