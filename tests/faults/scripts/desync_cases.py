"""Runs several cases of desync.py, one after another, in one worker task: torch and phalanx are
imported once here, and each case runs in a child forked from this process (a fresh process
state, its own cluster ports and transport settings), so a case costs no interpreter start-up.

usage: desync_cases.py CASES_JSON

CASES_JSON: a list of ``{"name": str, "args": [MODE, STEPS], "cluster": {"worker": [addr, addr]},
"env": {VAR: value}}``: the case's TF_CONFIG cluster and its transport variables (those of
TRANSPORT_VARS it does not name are unset). Every task of the cluster runs the same list in the
same order; this task's index is its own ``TF_CONFIG``'s.

For each case this prints ``CASE <name> BEGIN``, then the case's own lines (desync.py's), then
``CASE <name> END <exit code>``. A case still running after CASE_TIMEOUT seconds is killed
(SIGKILL, code -9) and the next one starts: a hang is named by its case and stops no other.
"""

import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

import torch  # noqa: F401  (imported once for every case: what the fork saves)
import torch.distributed  # noqa: F401
from torch import nn  # noqa: F401

import phalanx  # noqa: F401
import phalanx.errors  # noqa: F401

DESYNC = Path(__file__).resolve().parent / "desync.py"
CASE_TIMEOUT = 120.0  # seconds; a case takes a few (its mismatch ends it at step 5)
TRANSPORT_VARS = ("PHALANX_SHARED_MEMORY", "PHALANX_COLLECTIVES")

task = json.loads(os.environ["TF_CONFIG"])["task"]


def run_case(case: dict) -> None:
    """In the forked child: the case's environment and TF_CONFIG, then desync.py as __main__."""
    for name in TRANSPORT_VARS:
        os.environ.pop(name, None)
    os.environ.update(case["env"])
    os.environ["TF_CONFIG"] = json.dumps({"cluster": case["cluster"], "task": task})
    sys.argv = [str(DESYNC), *map(str, case["args"])]
    code = 1
    try:
        runpy.run_path(str(DESYNC), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never back into the loop below: the parent runs the next case


def wait(pid: int, name: str) -> int:
    """The child's exit code (negative: the signal that ended it); kills it after CASE_TIMEOUT."""
    deadline = time.monotonic() + CASE_TIMEOUT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            print(f"CASE {name} still running after {CASE_TIMEOUT:g}s: killed", flush=True)
            os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.05)


for case in json.loads(sys.argv[1]):
    print(f"CASE {case['name']} BEGIN", flush=True)
    child = os.fork()
    if child == 0:
        run_case(case)
    print(f"CASE {case['name']} END {wait(child, case['name'])}", flush=True)
