"""CheckpointManager under two real MultiWorkerMirrored workers (processes on 127.0.0.1)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from phalanx.cluster import launch

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).parent / "scripts" / "latest_after_save.py"


@pytest.mark.timeout(180)
def test_every_worker_sees_the_chiefs_latest_checkpoint_right_after_save(tmp_path):
    ckpt_dir, out_dir = tmp_path / "ckpts", tmp_path / "out"
    out_dir.mkdir()
    out = io.StringIO()
    code = launch(SCRIPT, workers=2, args=[ckpt_dir, out_dir], timeout=150, out=out)
    assert code == 0, out.getvalue()
    expected = [str(ckpt_dir / f"ckpt-{n}.pt") for n in (1, 2, 3)]
    for rank in (0, 1):
        seen = json.loads((out_dir / f"latest-{rank}.json").read_text())
        assert [s["saved"] for s in seen] == expected
        assert [s["latest"] for s in seen] == expected, f"worker {rank}"
        assert [s["manager"] for s in seen] == expected, f"worker {rank}"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["checkpoint.json", "ckpt-2.pt", "ckpt-3.pt"]
