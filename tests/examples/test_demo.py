"""`phalanx demo` trains to > 90% test accuracy under every strategy it offers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phalanx.cli import DEFAULT_DEMO_STRATEGY, DEMO_STRATEGIES, _parser
from phalanx.cli.demo import STRATEGIES, default_strategy_name, run_demo
from support.cluster import run_python

pytestmark = pytest.mark.multiprocess  # the command-line tests start processes

CLUSTER_DEMOS = {"multi_worker_mirrored", "parameter_server"}


def test_demo_default_reaches_90_percent():
    assert run_demo(verbose=0) > 0.9


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - CLUSTER_DEMOS))
def test_demo_runs_under_every_strategy(name):
    assert run_demo(name, epochs=2, verbose=0) > 0.2


def test_cli_entry_point_prints_progress_and_accuracy():
    done = run_python("-m", "phalanx", "demo", "--epochs", 1, "--strategy", "one_device", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Epoch 1/1" in done.stdout
    assert "test accuracy:" in done.stdout


def test_cli_rejects_unknown_strategy():
    done = run_python("-m", "phalanx", "demo", "--strategy", "nope", timeout=60)
    assert done.returncode == 2
    assert "invalid choice" in done.stderr


def test_cli_multi_worker_demo_launches_two_workers():
    demo = ["-m", "phalanx", "demo", "--strategy", "multi_worker_mirrored", "--epochs", 2]
    done = run_python(*demo, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[worker-0] test accuracy:" in done.stdout
    assert "[worker-1] test accuracy:" not in done.stdout  # logs only from the chief


def test_cli_parameter_server_demo_starts_its_own_cluster():
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "demo", "--strategy", "parameter_server", "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ParameterServerStrategy(workers=2, ps=1)" in done.stdout
    assert "[chief-0] Epoch 2/2" in done.stdout
    accuracy = float(done.stdout.split("[chief-0] test accuracy: ")[1].split()[0])
    assert accuracy > 0.2


def test_cli_strategy_names_are_the_demos():
    # The CLI spells the names itself so that its parser never imports torch.
    assert sorted(DEMO_STRATEGIES) == sorted(STRATEGIES)
    assert default_strategy_name() == DEFAULT_DEMO_STRATEGY


def _options(parser):
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):  # the subcommands
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.dest != "help":
            yield parser.prog, action


def test_every_cli_option_has_help():
    missing = [f"{prog} {action.dest}" for prog, action in _options(_parser()) if not action.help]
    assert missing == []


def test_help_does_not_import_torch():
    code = (
        "import sys, runpy\n"
        "sys.argv = ['phalanx', '--help']\n"
        "try:\n    runpy.run_module('phalanx', run_name='__main__')\n"
        "except SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'grpc', 'phalanx.strategies', 'phalanx.cluster') "
        "if m in sys.modules)\n"
        "print('heavy modules:', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: phalanx" in done.stdout
    assert "heavy modules: []" in done.stdout


def test_subcommand_help_does_not_import_torch():
    code = (
        "import sys\nfrom phalanx.cli import main\n"
        "for argv in (['demo', '--help'], ['launch', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as exc:\n        assert exc.code == 0\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "torch imported: False" in done.stdout
