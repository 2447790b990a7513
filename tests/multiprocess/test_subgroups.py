"""A group a user makes with ``torch.distributed.new_group()`` inside a MultiWorkerMirrored
program is checked as the job's group is (`phalanx.communication.group.subgroups`): a collective one
worker alone makes on it in the middle of training is named on both workers, at once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx.communication.group.recent_works import SUBGROUP_KEEP_WORKS_COUNT
from support.cluster import LocalCluster

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parent / "scripts" / "subgroup_collectives.py"
TRANSPORTS = {"shared_memory": {}, "gloo": {"PHALANX_SHARED_MEMORY": "0"}}
DIVERGE = 5


def _run(mode: str, transport: str, **env: str):
    with LocalCluster(2, env={**TRANSPORTS[transport], **env}) as cluster:
        run = cluster.start(SCRIPT, mode).wait(timeout=150)
        names = [f"worker:{i} ({cluster.address(f'worker-{i}')})" for i in range(2)]
    return run, names


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_subgroup_collective_of_one_worker_fails_on_both_at_once(transport):
    run, names = _run("stray", transport)
    assert "finished without an error" not in run.output
    for rank in range(2):
        task = run[f"worker-{rank}"]
        assert task.returncode != 0, run.output
        assert "BACKEND phalanx" in task.output  # not torch's plain gloo
        match = re.search(r"^MISMATCH (\d+) (.*)$", task.output, re.MULTILINE)
        assert match is not None, run.output
        # worker:1's stray all-reduce (3 numbers) met worker:0's loss all-reduce (a scalar)
        assert int(match.group(1)) == DIVERGE, run.output
        message = match.group(2)
        assert "differs between workers; no result of it was used" in message, message
        assert f"{names[0]} issued all_reduce #{DIVERGE + 1}" in message, message
        assert f"{names[1]} issued all_reduce #{DIVERGE + 1}" in message, message
        assert "float32[3]" in message, message
        assert "float32[1]" in message, message  # the loss, laid flat
        assert "subgroup_collectives.py:" in message, message  # both call sites


def test_a_subgroup_collective_that_meets_nothing_is_named_by_the_stall_inspector():
    # a group of every worker is watched by the job's stall inspector: worker:1 waits in the
    # subgroup's all-reduce while worker:0 waits in the job's next collective
    run, names = _run("lonely", "gloo", PHALANX_STALL_TIMEOUT_SECONDS="4")
    assert "finished without an error" not in run.output
    for rank in range(2):
        task = run[f"worker-{rank}"]
        assert task.returncode != 0, run.output
        match = re.search(r"^MISMATCH (\d+) (.*)$", task.output, re.MULTILINE)
        assert match is not None, run.output
        message = match.group(2)
        assert message.startswith("Every worker must call the same collectives in the same order"), message
        assert "subgroup_collectives.py:" in message, message
        assert all(name in message for name in names), message


def test_a_subgroup_whose_workers_agree_sums_and_finishes():
    run, _ = _run("plain", "gloo")
    run.check()
    steps = [
        re.findall(r"^STEP (\d+) (\S+) (\S+)$", run[f"worker-{r}"].output, re.MULTILINE) for r in range(2)
    ]
    assert len(steps[0]) == 8
    assert steps[0] == steps[1]  # the same summed loss and weights on both
    for rank in range(2):
        # a subgroup holds only the works its gloo threads may still hold (12 MiB each here):
        # FSDP2's gathered layers over a mesh's batch axis go when FSDP2 lets them go, not 16
        # collectives later (the job's count kept all ten: 120 MiB)
        held = re.search(r"^HELD (\S+)$", run[f"worker-{rank}"].output, re.MULTILINE)
        assert held is not None, run.output
        assert float(held.group(1)) < 12 * (SUBGROUP_KEEP_WORKS_COUNT + 1), run.output
