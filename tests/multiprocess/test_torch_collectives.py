"""A user's own torch.distributed calls inside a MultiWorkerMirrored program run on phalanx's
process group (`phalanx.communication.group.process_group`) on every transport, with no
init_process_group of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cluster import run_cluster

pytestmark = pytest.mark.multiprocess
SCRIPTS = Path(__file__).parent / "scripts"
TRANSPORTS = {
    "shared_memory": {},
    "gloo": {"PHALANX_SHARED_MEMORY": "0"},
    "tls": {"PHALANX_COLLECTIVES": "tls", "PHALANX_SHARED_MEMORY": "0"},
}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_user_collectives_ddp_dcp_and_fsdp2_run_on_the_jobs_group(tmp_path, transport):
    run_cluster(
        SCRIPTS / "torch_collectives.py", tmp_path, workers=2, env=TRANSPORTS[transport], timeout=240
    ).check()
    results = [json.loads((tmp_path / f"torch-{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["backend"] == "phalanx"  # not torch's plain gloo, on any transport
        assert result["uses_tls"] == (transport == "tls")
        assert result["uses_shm"] == (transport == "shared_memory")
        assert result["all_reduce"] == [3.0] * 5
        assert result["all_reduce_max"] == 2.0
        assert result["all_gather"] == [[0, 0], [1, 10]]
        assert result["all_gather_coalesced_2"] == [[0.0, 1.0], [10.0, 11.0]]  # [rank][i]
        assert result["all_gather_coalesced_3"] == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]
        assert "one list of 1 output tensors per worker (2)" in result["all_gather_coalesced_error"]
        assert result["all_to_all_single"] == [float(rank), 10.0 + rank]
        assert result["new_group_all_reduce"] == 3.0
        assert result["sparse_all_reduce"] == [1.0, 1.0, 30.0]
        assert "with ReduceOp.SUM. Received: all_reduce of 1 tensor(s), op" in result["sparse_error"]
        assert result["all_gather_into_tensor"] == [0.5, -0.5, 1.5, -1.5]
        assert result["reduce_scatter_tensor"] == [[1.0, 3.0], [5.0, 7.0]][rank]  # (0..3) + (1..4)
        assert result["broadcast"] == [1.0, 7.0]
        assert result["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert result["future"] == [2.0, 2.0, 2.0]
        assert result["dcp"] == [3.0] * 4  # a replicated tensor: the chief's copy is saved
        if rank == 0:
            assert result["new_group_some"] == 7.0  # a group of some workers, on every transport
        if transport == "tls":  # every one of the user's collectives went around the TLS ring
            assert "worker 0 sends 1 elements to worker 0, which expects 2" in result["all_to_all_error"]
            assert result["ring_carried"] >= 10, result
        else:
            assert result["ring_carried"] == 0
        assert result["p2p"] == ["sent", [5.0]][rank]  # under TLS over the point-to-point TLS links
    assert results[0]["ddp_grad"] == pytest.approx(results[1]["ddp_grad"])
    assert results[0]["fsdp2"] == pytest.approx(results[1]["fsdp2"])  # one model, sharded
    assert len(results[0]["fsdp2"]) == 4


def _repeats(tmp_path, mode: str) -> list[dict]:
    run_cluster(
        SCRIPTS / "repeated_all_reduces.py", tmp_path, mode, workers=2, env=TRANSPORTS["gloo"], timeout=120
    ).check()
    return [json.loads((tmp_path / f"repeats-{r}.json").read_text()) for r in range(2)]


def test_a_repeated_all_reduce_over_gloo_is_one_call_once_predicted_and_sums_right(tmp_path):
    # `phalanx.communication.transports.gloo.repeats`: W = 2, a first message is 1064 float32 (1054 payload)
    for result in _repeats(tmp_path, "alike"):
        sums, calls = result["staged"]
        assert sums == [3.0, 5.0, 7.0, 9.0, 11.0]
        assert calls == [[1064, 64482]] * 2 + [[65536 + 10]] * 3  # the codes after the tensor
        sums, calls = result["pipelined"]
        assert sums == [3.0, 5.0, 7.0, 9.0, 11.0]
        assert calls[0] == [65546, 1064, 262144 - 1054]  # zeros of the predicted size: every worker broke
        assert calls[-1] == [10, 262144]  # 1 MiB: the codes beside it, the tensor in place
        sums, calls = result["max_int"]
        assert sums == [2, 3, 4, 5, 6, 7, 8, 9]
        assert calls[-1] == [65546]  # int64, MAX: the codes with the op's neutral value
        assert result["broadcast"] == 1.0
        sums, calls = result["after_break"]
        assert sums == [3.0 + 2 * i for i in range(8)]
        assert calls[-1] == [65546]
        assert result["small"] == [3.0, 3.0, 3.0]


def test_a_predicted_all_reduce_that_one_worker_does_not_make_fails_on_both_with_the_tensor_untouched(
    tmp_path,
):
    results = _repeats(tmp_path, "stray")
    for rank, result in enumerate(results):
        assert "collective #5 differs between workers; no result of it was used" in result["error"]
        assert "float32[5]" in result["error"]
        assert "float32[65536]" in result["error"]
        assert result["tensor"] == rank + 1.0  # worker 0's predicted all-reduce left it as it was
