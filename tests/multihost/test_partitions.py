"""A network partition mid-training ends on both sides, promptly, naming the lost task; a job
restarted on the same hosts resumes from its BackupAndRestore backup."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from multihost.cluster import start_workers, wait_all, wait_for

pytestmark = pytest.mark.multihost

BOUND = 30.0  # seconds from the cut to both sides' exit (the default heartbeat bound is 10 s)


def _steps(out_dir: Path, rank: int) -> int:
    path = out_dir / f"steps-{rank}"
    return int(path.read_text() or 0) if path.exists() else 0


@pytest.mark.parametrize(
    ("victim", "token"),
    [(1, None), (0, None), (1, "multihost-cut-token-0123456789abcdef")],
    ids=["worker-cut", "chief-cut", "worker-cut-tls"],
)
def test_a_partitioned_worker_and_its_peer_both_exit_naming_each_other(make_hosts, tmp_path, victim, token):
    hosts = make_hosts(2)
    env = {"PHALANX_CLUSTER_TOKEN": token} if token else {}
    workers = start_workers(hosts, "train_until_cut.py", [tmp_path], **env)
    wait_for(lambda: min(_steps(tmp_path, 0), _steps(tmp_path, 1)) >= 5, 120, workers, "5 steps on each host")
    hosts[victim].cut()
    cut_at = time.time()
    codes, output = wait_all(workers, timeout=BOUND + 30)
    exited_after = time.time() - cut_at
    assert None not in codes, f"a worker still ran {BOUND + 30:g}s after the cut:\n{output}"
    assert all(code != 0 for code in codes), output
    assert exited_after <= BOUND, output
    names = ["worker:0 (", "worker:1 ("]
    for rank in range(2):
        raised_at, message = (tmp_path / f"error-{rank}.txt").read_text().split("\n", 1)
        assert float(raised_at) - cut_at <= BOUND
        assert names[1 - rank] in message.split(":", 1)[1].split("HINT")[0]  # names the other side
    assert "stopped sending heartbeats" in (tmp_path / "error-0.txt").read_text()
    assert "has not answered a heartbeat" in (tmp_path / "error-1.txt").read_text()


def test_backup_and_restore_resumes_a_multi_host_job_after_a_partition(make_hosts, tmp_path):
    hosts = make_hosts(2)
    args = [tmp_path, 2, 1]  # the cut comes at epoch 2, batch 1: the backup holds epochs 0 and 1
    workers = start_workers(hosts, "fit_across_a_partition.py", args)
    at_cut = [tmp_path / f"at-cut-{r}" for r in range(2)]
    wait_for(lambda: all(p.exists() for p in at_cut), 180, workers, "both workers at the cut")
    hosts[1].cut()
    (tmp_path / "cut").touch()
    codes, output = wait_all(workers, timeout=BOUND + 30)
    assert None not in codes, output
    assert all(c != 0 for c in codes), output
    assert "PeerUnavailableError" in output
    assert not list(tmp_path.glob("final-*.pt"))
    first = [(tmp_path / f"batches-{r}").read_text().split("\n") for r in range(2)]
    for r in range(2):
        (tmp_path / f"batches-{r}").unlink()

    hosts[1].heal()
    codes, output = wait_all(start_workers(hosts, "fit_across_a_partition.py", args), timeout=180)
    assert codes == [0, 0], output
    per_epoch = 64 // 16
    for r in range(2):
        assert first[r][: 2 * per_epoch + 1] == [f"{e} {b}" for e in range(2) for b in range(per_epoch)] + [
            "2 0"
        ]
        resumed = (tmp_path / f"batches-{r}").read_text().split()
        # the restarted job trains epochs 2 and 3 only: the right number of steps in all
        assert resumed == [str(v) for e in (2, 3) for b in range(per_epoch) for v in (e, b)]
        assert (tmp_path / f"final-{r}.pt").exists()
    assert not (tmp_path / "backup").exists()  # deleted after the completed fit
