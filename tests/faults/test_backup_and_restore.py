"""fit with BackupAndRestore, killed with SIGKILL mid-epoch, resumes to the uninterrupted result."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "fit_with_backup.py"


def _run(tmp, name, save_freq, kill, strategy):
    out = tmp / f"{name}.pt"
    cmd = [sys.executable, str(SCRIPT), str(tmp / f"backup-{name}"), str(out), save_freq, *kill, strategy]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120), out


@pytest.mark.parametrize(
    ("save_freq", "strategy"),
    [("epoch", "one_device"), ("3", "one_device"), ("epoch", "mirrored"), ("4", "mirrored")],
)
def test_killed_fit_resumes_to_the_uninterrupted_weights(tmp_path, save_freq, strategy):
    reference_dir = tmp_path / "ref"
    reference_dir.mkdir()
    done, ref_out = _run(reference_dir, "ref", save_freq, ("-1", "-1"), strategy)
    assert done.returncode == 0, done.stderr

    killed, out = _run(tmp_path, "run", save_freq, ("2", "4"), strategy)  # epoch 3 of 4, mid-epoch
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    assert os.path.exists(tmp_path / "backup-run" / "backup.pt")
    resumed, out = _run(tmp_path, "run", save_freq, ("2", "4"), strategy)
    assert resumed.returncode == 0, resumed.stderr

    expected, got = torch.load(ref_out), torch.load(out)
    for key, value in expected["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert not (tmp_path / "backup-run").exists()  # deleted after a completed fit


def test_multi_worker_fit_killed_on_one_worker_resumes_exactly(tmp_path):
    from phalanx.cluster import launch

    def run(name, kill):
        out = io.StringIO()
        target = tmp_path / name
        target.mkdir(exist_ok=True)
        args = [str(target / "backup"), str(target / "final.pt"), "epoch", *kill, "multi_worker"]
        return (
            launch(str(SCRIPT), workers=2, args=args, timeout=120, out=out),
            out.getvalue(),
            target / "final.pt",
        )

    code, log, ref_out = run("ref", ("-1", "-1"))
    assert code == 0, log
    code, log, out = run("run", ("2", "4"))
    assert code == -signal.SIGKILL, log  # worker-1 died; the launcher stopped worker-0
    assert not out.exists()
    code, log, out = run("run", ("2", "4"))
    assert code == 0, log
    expected, got = torch.load(ref_out), torch.load(out)
    for key, value in expected["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert not any(p.name.startswith("workertemp") for p in (tmp_path / "run").iterdir())
