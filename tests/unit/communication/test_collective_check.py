"""Signed collectives (`phalanx.communication.checks.collective_check`, `signed_gloo`): codes that are
the same on every worker for the same collective, headers that survive every reduction in
every dtype, and the switch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.communication.checks.collective_check import (
    CHECK_ENV,
    CollectiveCheck,
    Signed,
    check_enabled,
    code_of,
)
from phalanx.communication.transports.gloo import signed as signed_gloo
from phalanx.errors import CollectiveMismatchError


def test_a_code_depends_on_number_kind_dtype_and_size_only():
    t = torch.zeros(13)
    assert code_of(3, "all_reduce(SUM)", t) == code_of(3, "all_reduce(SUM)", torch.ones(13))
    assert code_of(3, "all_reduce(SUM)", t) == code_of(3, "all_reduce(SUM)", torch.zeros(13, 1))
    others = {
        code_of(4, "all_reduce(SUM)", t),
        code_of(3, "all_reduce(MAX)", t),
        code_of(3, "all_reduce(SUM)", t.double()),
        code_of(3, "all_reduce(SUM)", torch.zeros(())),
    }
    assert code_of(3, "all_reduce(SUM)", t) not in others
    assert all(0 < c < 2**31 for c in others)


def test_the_switch_is_on_by_default_and_refuses_a_typo(monkeypatch):
    monkeypatch.delenv(CHECK_ENV, raising=False)
    assert check_enabled()
    monkeypatch.setenv(CHECK_ENV, "0")
    assert not check_enabled()
    monkeypatch.setenv(CHECK_ENV, "of")
    with pytest.raises(ValueError, match="PHALANX_COLLECTIVE_CHECK must be 1 or 0"):
        check_enabled()


def test_signing_numbers_every_collective_and_an_off_check_sends_no_code():
    check = CollectiveCheck(0, 2, lambda r: f"worker:{r}")
    first, second = (
        check.sign("all_gather", torch.zeros(2), "x"),
        check.sign("all_gather", torch.zeros(2), "x"),
    )
    assert (first.seq, second.seq) == (1, 2)
    assert first.code
    assert first.code != second.code
    assert first.signature is not None
    assert "test_collective_check.py" in first.signature.site
    off = CollectiveCheck(0, 2, lambda r: f"worker:{r}", enabled=False)
    assert off.sign("all_gather", torch.zeros(2), "x") == Signed(1, 0, None)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64],
)
@pytest.mark.parametrize(
    "op", [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
)
def test_every_workers_code_survives_the_reduction_of_the_first_message(dtype, op):
    world, combine = (
        3,
        {
            dist.ReduceOp.SUM: torch.add,
            dist.ReduceOp.MAX: torch.maximum,
            dist.ReduceOp.MIN: torch.minimum,
            dist.ReduceOp.PRODUCT: torch.mul,
        }[op],
    )
    codes = [2**31 - 1, 12345, 1]
    messages = [signed_gloo.first_message(r, world, Signed(1, codes[r]), dtype, op) for r in range(world)]
    assert {m.numel() * m.element_size() for m in messages} == {signed_gloo.first_bytes(world)}
    reduced = messages[0]
    for m in messages[1:]:
        reduced = combine(reduced, m)
    header = reduced[reduced.numel() - signed_gloo.PIECES * world :]
    assert signed_gloo._codes(header, world) == codes


def test_a_differing_code_raises_the_report_with_the_peer():
    seen = []

    def mismatch(signed, peer):
        seen.append(peer)
        return CollectiveMismatchError("differs")

    mine = signed_gloo.first_message(0, 2, Signed(1, 77), torch.float32, dist.ReduceOp.SUM)
    theirs = signed_gloo.first_message(1, 2, Signed(1, 78), torch.float32, dist.ReduceOp.SUM)
    with pytest.raises(CollectiveMismatchError, match="differs"):
        signed_gloo.verify_header(mine + theirs, 2, Signed(1, 77), mismatch)
    assert seen == [1]
    garbled = torch.full_like(mine, 1e6)  # another collective's data where the header should be
    with pytest.raises(CollectiveMismatchError):
        signed_gloo.verify_header(garbled, 2, Signed(1, 77), mismatch)
    assert seen == [1, None]


def test_the_report_without_a_store_names_this_worker_and_the_peer():
    check = CollectiveCheck(1, 2, lambda r: f"worker:{r}")
    signed = check.sign("all_reduce(SUM)", torch.zeros(()), "all_reduce")
    error = check.mismatch(signed, 0)
    assert "collective #1 differs between workers" in str(error)
    assert "worker:1 issued all_reduce #1" in str(error)
    assert "worker:0 issued another collective" in str(error)
    assert check.report is error
    assert check.mismatch(signed, 0) is error  # sticky
