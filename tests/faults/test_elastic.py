"""Elastic MultiWorkerMirrored (`phalanx launch --min-workers`): a SIGKILLed worker (the chief
included) does not end the job; the survivors re-form, take the chief's state and finish with
the weights of an uninterrupted run; a restarted worker joins; below the minimum the job stops
with a named error; under repeated kills (chaos) nothing hangs and no step is applied twice."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess

SCRIPTS = Path(__file__).parent / "scripts"
FIT, LOOP, PASS = SCRIPTS / "elastic_fit.py", SCRIPTS / "elastic_loop.py", SCRIPTS / "elastic_evaluate.py"
RECOVERY_BOUND = 15.0  # seconds from a loss to the survivors' next completed step (the issue's bound)


def _launch(*args: object, timeout: float = 240, **env: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "phalanx", "launch", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**_env(), **env})


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def _alone(script: Path, folder: Path, *args: object) -> dict:
    """The uninterrupted run: the script in one process (the global batch is the same)."""
    folder.mkdir()
    env = {k: v for k, v in _env().items() if k not in ("TF_CONFIG", "RANK", "WORLD_SIZE")}
    subprocess.run(
        [sys.executable, str(script), str(folder), *map(str, args)], check=True, env=env, timeout=240
    )
    return torch.load(folder / "weights-0-0.pt")


def _results(folder: Path) -> dict[str, dict]:
    return {p.stem: torch.load(p) for p in sorted(folder.glob("weights-*.pt"))}


def _assert_same_weights(results: dict[str, dict], reference: dict | None = None) -> None:
    first = next(iter(results.values()))["weights"]
    for name, result in results.items():
        for key, value in result["weights"].items():
            assert torch.equal(value, first[key]), (name, key)  # identical on every member
            if reference is not None:  # and the uninterrupted run's, up to summation order
                torch.testing.assert_close(value, reference["weights"][key], rtol=1e-4, atol=1e-5)


def _recovery_seconds(folder: Path, survivor: dict, rank: int) -> float:
    """From worker ``rank``'s SIGKILL to the survivor's next completed step."""
    killed_at = float((folder / f"killed-at-{rank}").read_text())
    return min(t for t in survivor["times"] if t > killed_at) - killed_at


@pytest.fixture(scope="module")
def fit_reference(tmp_path_factory):
    """The uninterrupted fit, validated after every epoch: the weights of every fit (validating
    changes none: the jobs without a validation pass must end with them too), and val_loss."""
    return _alone(FIT, tmp_path_factory.mktemp("fit") / "alone", 3, -1, -1, 0, 1)


TRANSPORTS = {
    "shared_memory": {"PHALANX_SHARED_MEMORY": "1"},
    "gloo": {"PHALANX_SHARED_MEMORY": "0"},
    # the mutual-TLS ring, forced on one machine (shared memory off): the ring is re-formed
    "tls": {
        "PHALANX_SHARED_MEMORY": "0",
        "PHALANX_COLLECTIVES": "tls",
        "PHALANX_CLUSTER_TOKEN": "elastic-test-token",
    },
}


def test_fit_survives_a_worker_lost_in_a_step_and_another_in_the_validation_pass(tmp_path, fit_reference):
    """On shared memory (the default on one machine), 4 workers: worker 3 is SIGKILLed at the
    start of step 20 (the others wait in that step), worker 2 in the 4th batch of the validation
    pass after epoch 0 (the others wait in that validation step). The survivors re-form each
    time (every re-formed group agrees on segments of its own), validate again from the start,
    so every epoch's val_loss is the uninterrupted run's (the whole validation set, once), and
    end with the uninterrupted run's weights."""
    run = _launch("--workers", 4, "--min-workers", 2, FIT, tmp_path, 3, "3,2", "20,v50", 0, 1)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "worker 3 kills itself in a training step" in output
    assert "worker 2 kills itself in a validation pass" in output
    for rank in (3, 2):
        assert f"worker-{rank} left at" in run.stderr  # the launcher logs the loss, with the time
        assert f"left: ['worker:{rank} (" in output  # so does the new chief
    results = _results(tmp_path)
    assert sorted(results) == ["weights-0-0", "weights-1-0"]
    _assert_same_weights(results, fit_reference)
    for result in results.values():
        assert result["workers"] == 2
        assert result["shared_memory"]  # the last re-formed group's
        assert not result["tls"]
        assert len(result["val_loss"]) == 3
        torch.testing.assert_close(result["val_loss"], fit_reference["val_loss"], rtol=1e-5, atol=1e-6)
        # every step once, and every validation pass once: 3 epochs of 50 batches, 3 x 10
        assert result["run_count"] == fit_reference["run_count"] == 150 + 3 * 10
    _assert_recovered(tmp_path, results["weights-0-0"], 3, "lost worker 3")


@pytest.mark.parametrize("transport", ["gloo", "tls"])
def test_fit_survives_a_sigkilled_worker(tmp_path, fit_reference, transport):
    """On gloo and on the TLS ring (shared memory: the test above): every re-formed group
    agrees on ring connections of its own."""
    run = _launch("--workers", 3, "--min-workers", 2, FIT, tmp_path, 3, 2, 20, **TRANSPORTS[transport])
    assert run.returncode == 0, run.stdout + run.stderr
    results = _results(tmp_path)
    assert sorted(results) == ["weights-0-0", "weights-1-0"]
    _assert_same_weights(results, fit_reference)
    for result in results.values():
        assert result["workers"] == 2
        assert not result["shared_memory"]  # the re-formed group's
        assert result["tls"] == (transport == "tls")
        assert result["run_count"] == 150  # every step once: 3 epochs of 50 batches
    _assert_recovered(tmp_path, results["weights-0-0"], 2, "lost worker 2")
    assert "worker-2 left at" in run.stderr  # the launcher logs the loss, with the time
    assert "left: ['worker:2 (" in run.stdout + run.stderr  # so does the new chief


def test_a_lost_chief_is_replaced_and_restarted_it_joins_after_the_members(tmp_path, fit_reference):
    """The chief (task 0) is SIGKILLed: task 1 becomes the chief; the restarted task 0 joins
    as the last rank and takes task 1's state (not the other way round)."""
    run = _launch("--workers", 3, "--min-workers", 2, "--max-restarts", 1, FIT, tmp_path, 3, 0, 20, 0.02)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    results = _results(tmp_path)
    assert sorted(results) == ["weights-0-1", "weights-1-0", "weights-2-0"]
    _assert_same_weights(results, fit_reference)  # the joiner's fresh weights were not handed out
    assert all(r["workers"] == 3 and r["run_count"] == 150 for r in results.values())
    _assert_recovered(tmp_path, results["weights-1-0"], 0, "lost the chief")
    assert "worker-0 left at" in run.stderr
    assert "left: ['worker:0 (" in output  # logged by the new chief, worker:1
    assert "restarting worker-0 (restart 1 of 1)" in run.stderr
    assert "joined: ['worker:0 (" in output
    assert "[worker-0] Elastic membership" not in output  # the joiner never became the chief


@pytest.mark.parametrize(
    ("when", "said"),
    [
        ("start", "the first group formed with 2 workers"),  # never checked in: left out of epoch 0
        ("join", "Membership epoch 0's group did not form"),  # counted in, lost in the group's check-in
    ],
)
def test_a_worker_lost_while_the_workers_first_join_joins_when_restarted(tmp_path, fit_reference, when, said):
    """Worker 2 is SIGKILLed before the first step: the first group forms over the two others
    (at once: the membership took it for lost, no join timeout), and the restarted worker 2
    joins at the first step boundary, as any restarted worker does."""
    run = _launch("--workers", 3, "--min-workers", 2, "--max-restarts", 1, FIT, tmp_path, 3, 2, when, 0.02)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "worker 2 kills itself" in output
    assert said in output
    assert "restarting worker-2 (restart 1 of 1)" in run.stderr
    assert "joined: ['worker:2 (" in output
    results = _results(tmp_path)
    assert sorted(results) == ["weights-0-0", "weights-1-0", "weights-2-1"]
    _assert_same_weights(results, fit_reference)
    assert all(r["workers"] == 3 and r["run_count"] == 150 for r in results.values())


@pytest.mark.parametrize("what", ["evaluate", "predict"])
def test_evaluate_and_predict_on_their_own_survive_a_lost_worker(tmp_path, what):
    """Worker 2 dies in the 4th batch of `Model.evaluate` / `Model.predict` called on their own:
    the survivors re-form and run the pass again from its start, so the result is the
    uninterrupted run's; callbacks see the pass begin and end once and every batch once, in
    order. The restarted worker 2 is not admitted during the pass (its program starts over:
    it would meet the members nowhere): the job finishes without it."""
    alone, job = tmp_path / "alone", tmp_path / "job"
    alone.mkdir()
    job.mkdir()
    env = {k: v for k, v in _env().items() if k not in ("TF_CONFIG", "RANK", "WORLD_SIZE")}
    subprocess.run([sys.executable, str(PASS), str(alone), "-1", what], check=True, env=env, timeout=240)
    reference = torch.load(alone / "result-0-0.pt")
    run = _launch("--workers", 3, "--min-workers", 2, "--max-restarts", 1, PASS, job, 2, what)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert f"worker 2 kills itself in the 4th batch of {what}" in output
    assert "re-forms the group after" in output
    assert "joined: ['worker:2" not in output
    results = {p.stem: torch.load(p) for p in sorted(job.glob("result-*.pt"))}
    assert sorted(results) == ["result-0-0", "result-1-0"], output
    begin, end = ("test_begin", "test_end") if what == "evaluate" else ("predict_begin", "predict_end")
    batches = [event for i in range(10) for event in (f"begin {i}", f"end {i}")]
    for result in results.values():
        assert result["workers"] == 2
        assert result["events"] == [begin, *batches, end]
        assert result["run_count"] == reference["run_count"] == 10  # the redo is not counted twice
        torch.testing.assert_close(result["result"], reference["result"], rtol=1e-5, atol=1e-6)


def _assert_recovered(folder: Path, survivor: dict, rank: int, what: str) -> None:
    seconds = _recovery_seconds(folder, survivor, rank)
    print(f"{what}: the survivors' next step completed {seconds:.2f}s after the SIGKILL")
    assert seconds < RECOVERY_BOUND


def test_custom_loop_survives_a_worker_killed_mid_step(tmp_path):
    reference = _alone(LOOP, tmp_path / "alone", -1, -1)
    folder = tmp_path / "elastic"
    folder.mkdir()
    run = _launch("--workers", 3, "--min-workers", 2, LOOP, folder, 1, 40)
    assert run.returncode == 0, run.stdout + run.stderr
    results = _results(folder)
    assert sorted(results) == ["weights-0-0", "weights-2-0"]
    _assert_same_weights(results, reference)
    assert all(r["run_calls"] == 120 and r["workers"] == 2 for r in results.values())
    assert "re-forms the group after: the gradient all-reduce failed" in run.stdout + run.stderr


def test_below_min_workers_the_job_stops_with_a_named_error(tmp_path):
    run = _launch("--workers", 2, "--min-workers", 2, FIT, tmp_path, 3, 1, 10)
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert "BelowMinimumWorkersError" in output
    assert "fewer than the job's minimum of 2" in output
    assert "fewer than --min-workers 2 workers are left; stopping the job" in output
    assert not list(tmp_path.glob("weights-*.pt"))


CHAOS_BOUND = 90.0  # seconds of wall time from the first step to the job's end, kills and rejoins included
START_BOUND = 120.0  # seconds for three workers to start and make their first steps (the join timeout)
CHAOS_PAUSE = 0.05  # seconds after each of its 150 steps: 7.5 s of training at least, to kill in


def test_chaos_random_non_chief_kills_with_restarts(tmp_path, fit_reference):
    """Kills a random non-chief worker three times, 3-5 s apart once training runs, while the
    launcher restarts it; --min-workers 1, so two losses in a row (a replacement still
    starting) do not end the job. Bounded: CHAOS_BOUND seconds from the first step."""
    command = [sys.executable, "-m", "phalanx", "launch", "--workers", 3, "--min-workers", 1]
    command += ["--max-restarts", 10, FIT, tmp_path, 3, -1, -1, CHAOS_PAUSE]
    launched = time.monotonic()
    launcher = subprocess.Popen(
        list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
    )
    rng, kills, output = random.Random(23), [], ""
    try:
        while not (tmp_path / "backup").exists() and launcher.poll() is None:  # the first steps ran
            assert time.monotonic() - launched < START_BOUND, "no step within START_BOUND"
            time.sleep(0.1)
        training = time.monotonic()
        while len(kills) < 3 and launcher.poll() is None:
            time.sleep(rng.uniform(3, 5))
            victim = _newest_pid(tmp_path, rng.choice([1, 2]))
            if victim is not None and launcher.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it may have just finished
                    os.kill(victim, signal.SIGKILL)
                    kills.append(victim)
        try:  # no hang: the job ends by itself, in time
            output, _ = launcher.communicate(timeout=max(1.0, training + CHAOS_BOUND - time.monotonic()))
        except subprocess.TimeoutExpired:
            launcher.kill()
            output, _ = launcher.communicate()
            pytest.fail(f"the chaos job ran past {CHAOS_BOUND:g}s from its first step:\n{output}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
    print(
        f"chaos: {len(kills)} workers killed; first step {training - launched:.0f}s after the launch, "
        f"then {time.monotonic() - training:.0f}s to the end"
    )
    assert launcher.returncode == 0, output
    assert len(kills) == 3, output
    assert "terminate called" not in output, output  # no abort at exit (a gloo thread at finalization)
    results = _results(tmp_path)  # every task that finished: the last membership
    assert "weights-0-0" in results, output
    _assert_same_weights(results, fit_reference)  # every step once, whoever computed it
    assert all(r["run_count"] == 150 for r in results.values())


def _newest_pid(folder: Path, rank: int) -> int | None:
    files = sorted(folder.glob(f"pid-{rank}-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    return int(files[-1].read_text()) if files else None
