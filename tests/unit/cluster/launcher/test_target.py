"""How a target becomes a command line; errors for targets a new process cannot run."""

from __future__ import annotations

import base64
import json
import pickle
import sys

import pytest

from phalanx.cluster._bootstrap import exit_code
from phalanx.cluster._target import build_command


def test_a_script_runs_with_its_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert build_command(script, ["--epochs", 3], "py") == ["py", "-u", str(script), "--epochs", "3"]


def test_module_function_entry_goes_through_the_bootstrap():
    argv = build_command("phalanx.cli.demo:worker_main", ["1", "2"], "py")
    assert argv[:3] == ["py", "-u", "-c"]
    assert "def main(argv" in argv[3]
    spec = json.loads(argv[4])
    assert spec["entry"] == "phalanx.cli.demo:worker_main"
    assert argv[5:] == ["1", "2"]
    assert all(path for path in spec["sys_path"])  # '' became the working directory


def test_a_function_is_pickled_by_reference_with_its_args():
    spec = json.loads(build_command(json.dumps, [{"a": 1}], sys.executable)[4])
    assert pickle.loads(base64.b64decode(spec["payload"])) == (json.dumps, ({"a": 1},))
    assert "main_path" not in spec


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "missing.py",
            r"must be an existing script, 'module:function' or a function. Received: 'missing.py'",
        ),
        ("no_such_module_xyz:main", "module 'no_such_module_xyz' cannot be imported"),
        (lambda: 0, "must be a module-level function .* Received: .*<lambda>"),
    ],
)
def test_targets_a_new_process_cannot_run(target, message):
    with pytest.raises(ValueError, match=message):
        build_command(target, [], sys.executable)


def test_unpicklable_args_are_named():
    with pytest.raises(ValueError, match="picklable args"):
        build_command(json.dumps, [lambda: 0], sys.executable)


def test_functions_of_an_interactive_main_are_rejected(monkeypatch):
    def interactive():
        return 0

    interactive.__module__, interactive.__qualname__ = "__main__", "interactive"
    main = type(sys)("__main__")
    main.interactive = interactive
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(ValueError, match="defined in an interactive session"):
        build_command(interactive, [], sys.executable)


def test_a_functions_result_becomes_the_exit_code():
    assert [exit_code(r) for r in (None, 0, 3, True, "done", 0.5)] == [0, 0, 3, 0, 0, 0]
