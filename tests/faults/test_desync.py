"""A collective that one worker makes in the middle of training fails at once on every worker,
on every transport, before any result of it is used (`phalanx.communication.collective_check`).

Each case runs tests/faults/scripts/desync.py on a real 2-worker cluster: both workers must
exit non-zero with `CollectiveMismatchError` naming both call sites, and hold the weights of
the last step before the stray collective (no weight was updated with a mismatched sum). The
stall bound stays at its default (30 s): a report that names both sides as "issued" comes from
the check at the collective, not from the stall inspector.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.cluster import LocalCluster

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).resolve().parent / "scripts" / "desync.py"
TRANSPORTS = {
    "shared_memory": {},
    "gloo": {"PHALANX_SHARED_MEMORY": "0"},
    "tls": {"PHALANX_COLLECTIVES": "tls", "PHALANX_SHARED_MEMORY": "0"},
}
# forced TLS on one machine: shared memory carries every collective, the ring none
ALL_TRANSPORTS = {**TRANSPORTS, "tls_shared_memory": {"PHALANX_COLLECTIVES": "tls"}}
DIVERGE = 5
# what worker:1 issued at the mismatch (its stray collective, or its next one)
STRAY = {
    "reduce": "(strategy.reduce at desync.py:",
    "gather": "(strategy.gather at desync.py:",
    "user_all_reduce": "desync.py:",
    "broadcast": "desync.py:",
    "extra_backward": "(loss.backward at desync.py:",
    "in_backward": "desync.py:",
    "between_passes": "(strategy.reduce at desync.py:",
}


def _run(mode: str, transport: str, *args: str):
    with LocalCluster(2, env=ALL_TRANSPORTS[transport]) as cluster:
        run = cluster.start(SCRIPT, mode, *args).wait(timeout=150)
        names = [f"worker:{i} ({cluster.address(f'worker-{i}')})" for i in range(2)]
    return run, names


def _report(output: str) -> tuple[int, str, str]:
    """(steps completed, weights' checksum, message) from a worker's ``MISMATCH`` line."""
    match = re.search(r"^MISMATCH (\d+) (\S+) (.*)$", output, re.MULTILINE)
    assert match is not None, output
    return int(match.group(1)), match.group(2), match.group(3)


def _checksum_after(output: str, step: int) -> str:
    match = re.search(rf"^STEP {step} (\S+)$", output, re.MULTILINE)
    assert match is not None, output
    return match.group(1)


def _check(run, names, expected_steps: int, sides: list[str], stepped: tuple[int, ...] = ()) -> None:
    """``stepped``: workers that legitimately applied one more (matched) step before the mismatch."""
    assert "finished without an error" not in run.output
    for rank in range(2):
        task = run[f"worker-{rank}"]
        assert task.returncode != 0, run.output
        steps, weights, message = _report(task.output)
        assert steps == expected_steps, run.output
        if steps and rank not in stepped:  # the weights of the last matched step: nothing of
            assert weights == _checksum_after(task.output, steps - 1), run.output  # it applied
        assert "differs between workers; no result of it was used" in message, message
        assert f"{names[0]} issued " in message, message
        assert f"{names[1]} issued " in message, message
        for side in sides:
            assert side in message, message


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("mode", [mode for mode in STRAY if mode not in ("reduce", "between_passes")])
def test_a_collective_of_one_worker_mid_training_fails_on_both_at_once(mode, transport):
    run, names = _run(mode, transport)
    # worker:0 meets the stray collective with the gradient all-reduce of step DIVERGE
    # (extra_backward: worker:1's second backward meets worker:0's logging reduce)
    # (extra_backward: worker:1's first backward of step DIVERGE matched worker:0's, which
    # applied that step with the right sum; worker:1's second one meets worker:0's logging)
    extra = mode == "extra_backward"
    worker0 = "(strategy.reduce at desync.py:" if extra else "(loss.backward at desync.py:"
    worker1 = "(loss.backward at desync.py:" if extra else STRAY[mode]
    _check(run, names, DIVERGE, [worker0, worker1], stepped=(0,) if extra else ())


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_models_built_differently_fail_at_the_first_collective(transport):
    run, names = _run("shapes", transport)
    # the chief's broadcast of the initial values, of 178 and 189 numbers
    _check(run, names, 0, ["float32[178]", "float32[189]"])


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_stray_reduce_at_step_5_of_100000_ends_both_workers(transport):
    # issue 21's scenario, and the mid-training case of a stray `strategy.reduce` (one run
    # covers both): it ends because of the check, long before 100,000 steps
    run, names = _run("reduce", transport, "100000")
    _check(run, names, DIVERGE, ["(loss.backward at desync.py:", STRAY["reduce"]])


def test_a_collective_of_one_worker_between_passes_announced_by_the_pass_before_fails_on_both():
    # over gloo the gradient all-reduces of step DIVERGE go without a first message (the step
    # before announced them): worker:1's stray reduce breaks that with zeros, and each side
    # sees the break before any result of it is used
    run, names = _run("between_passes", "gloo")
    _check(run, names, DIVERGE, ["(loss.backward at desync.py:", STRAY["between_passes"]])


def test_forced_tls_on_one_machine_meets_a_broadcast_with_the_all_reduce_it_pairs_with():
    # every collective of workers on one machine takes shared memory, TLS forced or not: a
    # stray broadcast meets the gradient all-reduce in the same control block (not the ring)
    run, names = _run("broadcast", "tls_shared_memory")
    _check(run, names, DIVERGE, ["(loss.backward at desync.py:", STRAY["broadcast"]])


def test_a_collective_inside_backward_on_every_worker_is_no_mismatch():
    # over gloo it breaks the announced gradient all-reduces on every worker alike
    # (phalanx.communication.gloo_transport): the sums stay right
    runs = {}
    for mode in ("in_backward_all", "plain"):
        with LocalCluster(2, env=TRANSPORTS["gloo"]) as cluster:
            runs[mode] = cluster.start(SCRIPT, mode).wait(timeout=150)
    for run in runs.values():
        assert "finished without an error" in run.output, run.output
        for rank in range(2):
            assert run[f"worker-{rank}"].returncode == 0, run.output
    last = {
        (mode, rank): _checksum_after(run[f"worker-{rank}"].output, 7)
        for mode, run in runs.items()
        for rank in range(2)
    }
    assert len(set(last.values())) == 1, last
