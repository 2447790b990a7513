"""Workers that take different paths are named within the stall bound, and all exit non-zero.

Each case runs tests/faults/scripts/stall_paths.py on a real 2-worker cluster with a 3 s stall
bound: the message must name each worker's pending collective (number and call site in the
script), and every worker must exit non-zero (nothing waits for the 600 s collective deadline).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.cluster import LocalCluster

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).resolve().parent / "scripts" / "stall_paths.py"
STALL_SECONDS = 3
# the bound + a heartbeat round (1 s) + a poll (0.5 s), with 3.5 s of slack for a loaded machine
REPORTED_WITHIN = STALL_SECONDS + 1 + 0.5 + 3.5


def _run(mode: str, **env: str):
    settings = {"PHALANX_STALL_TIMEOUT_SECONDS": str(STALL_SECONDS), **env}
    with LocalCluster(2, env=settings) as cluster:
        run = cluster.start(SCRIPT, mode).wait(timeout=90)
        names = [f"worker:{i} ({cluster.address(f'worker-{i}')})" for i in range(2)]
    return run, names


@pytest.fixture(scope="module")
def extra_reduce():
    """One run of the "extra_reduce" paths, read by the two tests that check it."""
    return _run("extra_reduce")


def _stall_report(output: str) -> tuple[float, str]:
    """(seconds since the paths diverged, message) from a worker's ``STALL`` line."""
    match = re.search(r"^STALL ([0-9.]+) (.*)$", output, re.MULTILINE)
    assert match is not None, output
    return float(match.group(1)), match.group(2)


CLOSING = "{1} is closing its strategy (strategy.close at stall_paths.py:"


@pytest.mark.parametrize(
    ("mode", "sides"),
    [
        # worker:1 stopped one batch early: worker:0 waits for the gradient buckets of its last step
        (
            "early_stop",
            ["{0} waits in the gradient all-reduce #8 (loss.backward at stall_paths.py:", CLOSING],
        ),
        # the chief alone "evaluates" with a strategy.reduce after the loop
        ("extra_reduce", ["{0} waits in all_reduce #10 (strategy.reduce at stall_paths.py:", CLOSING]),
    ],
)
def test_different_paths_are_named_on_every_worker_within_the_bound(mode, sides, request):
    # (a collective that meets another one is reported at once by the signature check:
    # tests/faults/test_desync.py; here one worker issues nothing while the other waits)
    run, names = request.getfixturevalue("extra_reduce") if mode == "extra_reduce" else _run(mode)
    for rank in range(2):
        task = run[f"worker-{rank}"]
        assert task.returncode != 0, run.output
        assert "CollectiveMismatchError" in task.output, run.output
        elapsed, message = _stall_report(task.output)
        assert elapsed < REPORTED_WITHIN, run.output  # from the start of the step it happens in
        assert message.startswith("Every worker must call the same collectives in the same order")
        for part in (*(side.format(*names) for side in sides), "Received: ", "HINT: "):
            assert part in message, message
    assert "finished without an error" not in run.output


def test_the_chief_warns_about_the_laggards_before_the_error(extra_reduce):
    run, names = extra_reduce
    assert f"Stalled collective: {names[0]} has waited" in run["worker-0"].output, run.output
    assert f"for ['{names[1]}'], which are not in the same collective" in run["worker-0"].output


@pytest.mark.parametrize("mode", ["skip_step", "fit"])
def test_a_collective_that_meets_another_is_named_at_once(mode):
    # skip_step: worker:1 skips the backward pass of step 2: its logging reduce meets worker:0's
    # gradient all-reduce. fit: the chief's reduce meets worker:1's broadcast of the initial values.
    run, names = _run(mode)
    for rank in range(2):
        task = run[f"worker-{rank}"]
        assert task.returncode != 0, run.output
        _, message = _stall_report(task.output)
        assert "differs between workers; no result of it was used" in message, message
        assert "(strategy.reduce at stall_paths.py:" in message, message
        assert all(f"{name} issued " in message for name in names), message


def test_detail_mode_names_the_first_collective_whose_shapes_differ():
    # worker:1 skips the backward pass of step 2: its logging reduce meets worker:0's gradient
    # all-reduce; DETAIL compares in the store as each collective is issued.
    run, names = _run("skip_step", PHALANX_DISTRIBUTED_DEBUG="DETAIL")
    for rank in range(2):
        task = run[f"worker-{rank}"]
        assert task.returncode != 0, run.output
        _, message = _stall_report(task.output)
        assert "but collective #6 differs" in message, message
        for part in (
            "(loss.backward at stall_paths.py:",
            # 178 gradients, 2 flags for each of 4 parameters, and the element the gloo transport
            # may mark a broken announcement in (phalanx.communication.transports.gloo.transport)
            "[all_reduce(SUM) of float32[187]]",
            "(strategy.reduce at stall_paths.py:",
            "[all_reduce(SUM) of float32[]]",
            *names,
        ):
            assert part in message, message
