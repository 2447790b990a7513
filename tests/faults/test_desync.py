"""A collective that one worker makes in the middle of training fails at once on every worker,
on every transport, before any result of it is used (`phalanx.communication.checks.collective_check`).

Each case runs tests/faults/scripts/desync.py on a real 2-worker cluster: both workers must
exit non-zero with `CollectiveMismatchError` naming both call sites, and hold the weights of
the last step before the stray collective (no weight was updated with a mismatched sum). The
stray collective comes at step 5 of a run of 100,000 steps: the check ends it. The stall bound
stays at its default (30 s): a report that names both sides as "issued" comes from the check
at the collective, not from the stall inspector.

One cluster per transport runs that transport's cases one after another
(scripts/desync_cases.py: a forked child per case, with ports of its own), the first time a
test asks for one of them; only the cases of the tests selected run (``-k`` works). Each
test reads its own case's result: a failure names the case in the test's id.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.cluster import ClusterRun, ClusterTimeout, LocalCluster, TaskResult, free_ports

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TRANSPORTS = {
    "shared_memory": {},
    "gloo": {"PHALANX_SHARED_MEMORY": "0"},
    "tls": {"PHALANX_COLLECTIVES": "tls", "PHALANX_SHARED_MEMORY": "0"},
}
# forced TLS on one machine: shared memory carries every collective, the ring none
ALL_TRANSPORTS = {**TRANSPORTS, "tls_shared_memory": {"PHALANX_COLLECTIVES": "tls"}}
CLUSTER_OF = {**{t: t for t in TRANSPORTS}, "tls_shared_memory": "tls"}  # the cluster that runs a case
DIVERGE = 5
LONG = 100_000  # steps of a mismatch case: only the check ends it
CASE_TIMEOUT = 120  # scripts/desync_cases.py's, per case
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
MID_TRAINING = [mode for mode in STRAY if mode not in ("reduce", "between_passes")]


def reads(*cases: tuple[str, str]):
    """Names the (mode, transport) cases an unparametrised test reads (see `_cases_of`)."""

    def mark(test):
        test.desync_cases = cases
        return test

    return mark


def _cases_of(item: pytest.Item) -> list[tuple[str, str]]:
    """The cases a test reads: its ``mode`` and ``transport`` parameters, or its `reads`."""
    params = getattr(item, "callspec", None)
    if params is not None and {"mode", "transport"} <= params.params.keys():
        return [(params.params["mode"], params.params["transport"])]
    return list(getattr(getattr(item, "function", None), "desync_cases", ()))


class DesyncRuns:
    """Each case's run, as a `ClusterRun` of its own (``worker-0``/``worker-1``: its code and
    its lines) and the workers' names in its messages. A cluster runs every selected case of
    its transport the first time one of them is asked for."""

    def __init__(self, wanted: set[tuple[str, str]]) -> None:
        self._wanted = wanted
        self._runs: dict[tuple[str, str], tuple[ClusterRun, list[str]] | str] = {}

    def __call__(self, mode: str, transport: str) -> tuple[ClusterRun, list[str]]:
        case = (mode, transport)
        if case not in self._runs:  # its cluster's cases (or, asked for unannounced, it alone)
            group = CLUSTER_OF[transport]
            cases = [c for c in sorted(self._wanted) if CLUSTER_OF[c[1]] == group and c not in self._runs]
            self._runs.update(_run_cases(cases if case in cases else [case]))
        result = self._runs[case]
        if isinstance(result, str):
            pytest.fail(result)
        return result


@pytest.fixture(scope="module")
def desync(request) -> DesyncRuns:
    here = Path(__file__).resolve()
    items = [item for item in request.session.items if Path(item.path).resolve() == here]
    return DesyncRuns({case for item in items for case in _cases_of(item)})


def _run_cases(cases: list[tuple[str, str]]) -> dict[tuple[str, str], tuple[ClusterRun, list[str]] | str]:
    """Runs ``cases`` in order on one 2-worker cluster, each with fresh ports."""
    ports = iter(free_ports(2 * len(cases)))
    specs = [
        {
            "name": f"{mode}-{transport}",
            "args": [mode, 8 if mode in ("in_backward_all", "plain") else LONG],
            "cluster": {"worker": [f"127.0.0.1:{next(ports)}" for _ in range(2)]},
            "env": ALL_TRANSPORTS[transport],
        }
        for mode, transport in cases
    ]
    try:
        with LocalCluster(2) as cluster:
            cluster.start(SCRIPTS / "desync_cases.py", json.dumps(specs))
            run = cluster.wait(timeout=CASE_TIMEOUT * len(cases) + 60)
    except ClusterTimeout as exc:  # every case of it fails with this, and runs no second time
        return dict.fromkeys(cases, f"the cluster of cases {[s['name'] for s in specs]}: {exc}")
    return {case: _case_run(run, spec) for case, spec in zip(cases, specs, strict=True)}


def _case_run(run: ClusterRun, spec: dict) -> tuple[ClusterRun, list[str]] | str:
    """One case's part of each worker's output, or why it is missing."""
    tasks, lines = {}, []
    for rank in range(2):
        name, output = f"worker-{rank}", run[f"worker-{rank}"].output
        case = re.escape(spec["name"])
        match = re.search(rf"^CASE {case} BEGIN\n(.*?)^CASE {case} END (-?\d+)$", output, re.S | re.M)
        if match is None:
            return f"case {spec['name']} did not run to its end on {name}. Every case's output:\n{run.output}"
        tasks[name] = TaskResult(name, int(match.group(2)), match.group(1))
        lines += [f"[{name}] {line}\n" for line in match.group(1).splitlines()]
    names = [f"worker:{i} ({address})" for i, address in enumerate(spec["cluster"]["worker"])]
    return ClusterRun(tasks, "".join(lines), tuple(tasks)), names


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
@pytest.mark.parametrize("mode", MID_TRAINING)
def test_a_collective_of_one_worker_mid_training_fails_on_both_at_once(desync, mode, transport):
    run, names = desync(mode, transport)
    # worker:0 meets the stray collective with the gradient all-reduce of step DIVERGE
    # (extra_backward: worker:1's first backward of step DIVERGE matched worker:0's, which
    # applied that step with the right sum; worker:1's second one meets worker:0's logging reduce)
    extra = mode == "extra_backward"
    worker0 = "(strategy.reduce at desync.py:" if extra else "(loss.backward at desync.py:"
    worker1 = "(loss.backward at desync.py:" if extra else STRAY[mode]
    _check(run, names, DIVERGE, [worker0, worker1], stepped=(0,) if extra else ())


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("mode", ["shapes"])
def test_models_built_differently_fail_at_the_first_collective(desync, mode, transport):
    run, names = desync(mode, transport)
    # the chief's broadcast of the initial values, of 178 and 189 numbers
    _check(run, names, 0, ["float32[178]", "float32[189]"])


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("mode", ["reduce"])
def test_a_stray_reduce_at_step_5_of_100000_ends_both_workers(desync, mode, transport):
    # a stray `strategy.reduce` in the middle of a long run: it ends because of the check,
    # long before 100,000 steps
    run, names = desync(mode, transport)
    _check(run, names, DIVERGE, ["(loss.backward at desync.py:", STRAY["reduce"]])


@reads(("between_passes", "gloo"))
def test_a_collective_of_one_worker_between_passes_announced_by_the_pass_before_fails_on_both(desync):
    # over gloo the gradient all-reduces of step DIVERGE go without a first message (the step
    # before announced them): worker:1's stray reduce breaks that with zeros, and each side
    # sees the break before any result of it is used
    run, names = desync("between_passes", "gloo")
    _check(run, names, DIVERGE, ["(loss.backward at desync.py:", STRAY["between_passes"]])


@reads(("broadcast", "tls_shared_memory"))
def test_forced_tls_on_one_machine_meets_a_broadcast_with_the_all_reduce_it_pairs_with(desync):
    # every collective of workers on one machine takes shared memory, TLS forced or not: a
    # stray broadcast meets the gradient all-reduce in the same control block (not the ring)
    run, names = desync("broadcast", "tls_shared_memory")
    _check(run, names, DIVERGE, ["(loss.backward at desync.py:", STRAY["broadcast"]])


@reads(("in_backward_all", "gloo"), ("plain", "gloo"))
def test_a_collective_inside_backward_on_every_worker_is_no_mismatch(desync):
    # over gloo it breaks the announced gradient all-reduces on every worker alike
    # (phalanx.communication.transports.gloo.transport): the sums stay right
    runs = {mode: desync(mode, "gloo")[0] for mode in ("in_backward_all", "plain")}
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
