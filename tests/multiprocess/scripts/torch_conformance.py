"""torch's own distributed tests (the suite upstream runs on gloo) on the phalanx backend.

The tests are the methods of ``torch.testing._internal.distributed.distributed_test.
DistributedTest._DistTestBase``, shipped in the torch wheel, with the environment upstream's
``test_distributed_spawn.py`` gives them (``BACKEND=gloo``, ``WORLD_SIZE``, ``TEMP_DIR``), so
the decorators keep the tests upstream runs on gloo. Upstream spawns 2 fresh processes per
test; here every task of the cluster runs the named tests one after the other on one default
group (a minute of start-up per test would not fit the suite's budget): the group a
MultiWorkerMirroredStrategy makes (``dist.get_backend() == "phalanx"``) on the transport the
environment picks, or with ``CONFORMANCE_BACKEND=gloo`` torch's plain gloo, the reference.

Writes ``conformance-<rank>.json`` to OUT_DIR: ``{test: "passed" | "skipped: ..." | "failed: ..."}``.

usage: torch_conformance.py OUT_DIR TEST_NAME...  (or OUT_DIR --list: every test's name
to OUT_DIR/names.json)
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import unittest
from pathlib import Path

out_dir, names = Path(sys.argv[1]), sys.argv[2:]
spec = json.loads(os.environ["TF_CONFIG"])
rank, world = spec["task"]["index"], len(spec["cluster"]["worker"])
os.environ.update(BACKEND="gloo", WORLD_SIZE=str(world), TEMP_DIR=str(out_dir / "torch-temp"))
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")

import torch.distributed as dist  # noqa: E402
from torch.testing._internal import common_utils  # noqa: E402
from torch.testing._internal.common_distributed import TEST_SKIPS  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

import phalanx  # noqa: E402

if names == ["--list"]:  # the names only (the chief writes them), no group
    if rank == 0:
        every = [n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_")]
        (out_dir / "names.json").write_text(json.dumps(every))
    sys.exit(0)

if os.environ.get("CONFORMANCE_BACKEND", "phalanx") == "gloo":
    dist.init_process_group(
        "gloo", init_method=f"tcp://{spec['cluster']['worker'][0]}", rank=rank, world_size=world
    )
else:
    strategy = phalanx.MultiWorkerMirroredStrategy()
    assert dist.get_backend() == "phalanx", dist.get_backend()


class TestPhalanx(TestDistBackend, DistributedTest._DistTestBase):
    """One test of torch's, run in this process (the harness's spawn is not used)."""


def run(name: str) -> str:
    case = TestPhalanx(name)
    case.rank, case.file_name = rank, str(out_dir / "torch-temp" / "init")
    common_utils.set_rng_seed()  # as the harness seeds each spawned worker
    try:
        getattr(case, name)()
    except unittest.SkipTest as exc:
        return f"skipped: {str(exc)[:200]}"
    except SystemExit as exc:  # how the harness's decorators skip inside a worker
        reasons = [s.message for s in TEST_SKIPS.values() if s.exit_code == exc.code]
        if reasons:
            return f"skipped: {reasons[0]}"
        return f"failed: exit {exc.code}"
    except BaseException as exc:  # the test's own failure: recorded, the next test runs
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()] or [type(exc).__name__]
        traceback.print_exc()
        return f"failed: {type(exc).__name__}: {lines[0][:300]}"
    return "passed"


if rank == 0:
    (out_dir / "torch-temp" / "barrier").mkdir(parents=True, exist_ok=True)
    (out_dir / "torch-temp" / "test_dir").mkdir(parents=True, exist_ok=True)
outcomes: dict[str, str] = {}
for name in names:
    dist.barrier()  # every worker starts each test together
    outcomes[name] = run(name)
    print(f"{name}: {outcomes[name]}", flush=True)
    (out_dir / f"conformance-{rank}.json").write_text(json.dumps(outcomes, indent=1))
dist.barrier()
