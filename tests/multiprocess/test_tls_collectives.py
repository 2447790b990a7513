"""MultiWorkerMirrored collectives over the TLS ring between real worker processes (127.0.0.1):
the same numbers as gloo, on every worker (`phalanx.communication.transports.tls.ring`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cluster import run_cluster

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"
TLS = {"PHALANX_COLLECTIVES": "tls", "PHALANX_SHARED_MEMORY": "0"}


@pytest.mark.parametrize("workers", [2, 3])
def test_the_tls_ring_agrees_with_gloo_and_is_identical_on_every_worker(tmp_path, workers):
    run_cluster(SCRIPTS / "shared_memory_checks.py", tmp_path, workers=workers, env=TLS, timeout=180).check()
    for rank in range(workers):
        result = json.loads((tmp_path / f"shm-{rank}.json").read_text())
        assert result["uses_tls"]
        assert not result["uses_shared_memory"]
        cases = result["cases"]
        assert len(cases) == 12
        assert all(c["close"] and c["same_on_every_worker"] for c in cases.values()), cases
        if workers == 2:  # a + b either way round: bit for bit what gloo gives
            assert all(c["equal"] for c in cases.values()), cases
        assert result["overlapped"] == sum(range(1, workers + 1))  # beside a MAX meanwhile
        assert result["reduce_sum"] == sum(range(1, workers + 1))
        assert result["broadcast"] == [1.0, 1.0, 1.0]
        assert result["all_gather"] == [10 * r for r in range(workers)]


def test_on_one_machine_collectives_stay_on_gloo_unless_tls_is_asked_for(tmp_path):
    run_cluster(
        SCRIPTS / "shared_memory_checks.py",
        tmp_path,
        workers=2,
        env={"PHALANX_SHARED_MEMORY": "0", "PHALANX_COLLECTIVES": "auto"},
        timeout=180,
    ).check()
    result = json.loads((tmp_path / "shm-0.json").read_text())
    assert not result["uses_tls"]  # auto: the traffic never leaves this machine's kernel
    assert all(c["equal"] for c in result["cases"].values())
