"""The gloo transport's ordering without processes: a fake one-worker gloo group that records
every call (`phalanx.communication.transports.gloo.transport`). Two real workers, mismatches included, run
in tests/faults/test_desync.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.communication.checks.collective_check import Signed, code_of, codes_after
from phalanx.communication.checks.signatures import Signature
from phalanx.communication.transports.gloo.repeats import PIPELINE_BYTES, Repeats
from phalanx.communication.transports.gloo.signed import first_bytes
from phalanx.communication.transports.gloo.transport import DataFlag, GlooTransport, announced_tail


class FakeWork:
    """A gloo work that finishes when the test says so (at once by default)."""

    def __init__(self, done: bool) -> None:
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        if done:
            self.finish()

    def finish(self) -> None:
        if not self.future.done():
            self.future.set_result([])

    def is_completed(self) -> bool:
        return self.future.done()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self.future

    def wait(self, timeout=None) -> bool:
        if not self.future.done():
            raise RuntimeError("timed out (still running)")
        return True


class FakeGroup:
    """One worker: a reduction is the tensor itself. Records (kind, element count)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.works: list[FakeWork] = []
        self.hold = False  # new works stay unfinished until released

    def _work(self, kind: str, tensor: torch.Tensor) -> FakeWork:
        self.calls.append((kind, tensor.numel()))
        self.works.append(FakeWork(not self.hold))
        return self.works[-1]

    def allreduce(self, tensors, options) -> FakeWork:
        return self._work("all_reduce", tensors[0])

    def broadcast(self, tensors, options) -> FakeWork:
        return self._work("broadcast", tensors[0])

    def release(self) -> None:
        self.hold = False
        for work in self.works:
            work.finish()


FIRST = first_bytes(1) // 4  # float32 elements of a first message


def _transport(group: FakeGroup) -> GlooTransport:
    def wait(work, what):
        group.release()
        work.wait()

    def mismatch(signed, peer):
        raise AssertionError(f"no mismatch with one worker: {signed}")

    return GlooTransport(group, 0, 1, mismatch, lambda work: work, checked=True, wait=wait)


def test_a_large_all_reduce_is_its_first_message_then_the_rest_before_anything_later():
    group = FakeGroup()
    transport = _transport(group)
    group.hold = True
    big = torch.ones(3000)
    work = transport.all_reduce_async(big, dist.ReduceOp.SUM, Signed(1, 11))
    assert group.calls == [("all_reduce", FIRST)]  # the rest waits for the codes to match
    transport.broadcast_async(torch.ones(2), 0, Signed(2, 12))  # waits (releases the fakes)
    capacity = FIRST - 5
    assert group.calls[:3] == [("all_reduce", FIRST), ("all_reduce", 3000 - capacity), ("all_reduce", FIRST)]
    work.wait()
    torch.testing.assert_close(big, torch.ones(3000))


def test_announced_all_reduces_go_as_one_call_each_behind_one_first_message():
    group = FakeGroup()
    transport = _transport(group)
    group.hold = True
    transport.announce(Signed(1, 21), [(5000, torch.float32, 31), (9, torch.float32, 32)])
    grads, last = torch.ones(5000), torch.ones(9)
    works = [
        transport.all_reduce_async(grads, dist.ReduceOp.SUM, Signed(2, 31)),
        transport.all_reduce_async(last, dist.ReduceOp.SUM, Signed(3, 32)),
    ]
    assert group.calls == [("all_reduce", FIRST)]  # queued until the announcement verified
    group.release()
    for work in works:
        work.wait()
    assert group.calls == [("all_reduce", FIRST), ("all_reduce", 5000), ("all_reduce", 9)]
    assert float(last[-1]) == 1.0  # the break mark: 1 from the one worker, which kept to it


def test_another_collective_breaks_the_announcement_with_zeros_and_ends_announcing():
    group = FakeGroup()
    transport = _transport(group)
    transport.announce(Signed(1, 21), [(5000, torch.float32, 31), (9, torch.float32, 32)])
    transport.all_reduce_async(torch.ones(5000), dist.ReduceOp.SUM, Signed(2, 31))
    transport.all_reduce_async(torch.ones(3), dist.ReduceOp.SUM, Signed(3, 99)).wait()  # inside backward
    # zeros of the announced size still to come (its mark says where it broke), then the collective
    assert group.calls[1:] == [("all_reduce", 5000), ("all_reduce", 9), ("all_reduce", FIRST)]
    assert not transport.announces  # every worker broke here: it would be paid every pass
    transport.announce(Signed(4, 22), [(9, torch.float32, 33)])
    assert len(group.calls) == 4


def test_a_collective_dropped_by_closing_its_transport_says_so():
    group = FakeGroup()
    transport = _transport(group)
    group.hold = True
    work = transport.all_reduce_async(torch.ones(3000), dist.ReduceOp.SUM, Signed(1, 11))
    transport.close()
    group.release()
    with pytest.raises(RuntimeError, match="its transport was closed"):
        work.wait()


def test_a_work_with_callbacks_finishes_by_itself_as_gloo_completes_its_calls():
    # the phalanx process group's works (DDP's hooks chain on them): nobody waits
    group = FakeGroup()
    transport = _transport(group)
    group.hold = True
    big = torch.ones(3000)
    work = transport.all_reduce_async(big, dist.ReduceOp.SUM, Signed(1, 11))
    seen: list[BaseException | None] = []
    work.add_done_callback(seen.append)
    assert seen == []
    assert len(group.calls) == 1
    group.release()  # the first message completes: its callback verifies and starts the rest
    assert seen == [None]
    assert [kind for kind, _ in group.calls] == ["all_reduce", "all_reduce"]
    assert work.is_completed()


def test_all_reduces_that_each_fit_in_a_first_message_are_not_worth_announcing():
    transport = _transport(FakeGroup())
    assert not transport.worth_announcing([(FIRST - 5, torch.float32), (9, torch.float32)])
    assert transport.worth_announcing([(FIRST - 4, torch.float32), (9, torch.float32)])
    assert not transport.worth_announcing([(2 * FIRST - 5, torch.float16)])  # 2 bytes each
    assert transport.worth_announcing([(2 * FIRST - 4, torch.float16)])


TAIL = announced_tail(1)


def _pass(transport, seq, specs, first_code=None, tail=TAIL):
    """One backward pass's all-reduces (codes as the group signs them); their works."""
    codes = codes_after(seq - 1, "all_reduce(SUM)", [(n, d) for n, d in specs])
    if first_code is not None:
        transport.announce(
            Signed(seq - 1, first_code), [(n, d, c) for (n, d), c in zip(specs, codes, strict=False)], tail
        )
    tensors = [torch.ones(n) for n, _ in specs]
    works = [
        transport.all_reduce_async(t, dist.ReduceOp.SUM, Signed(seq + i, c))
        for i, (t, c) in enumerate(zip(tensors, codes, strict=False))
    ]
    for work in works:
        work.wait()
    return tensors


def test_the_last_all_reduce_of_a_pass_announces_the_next_which_then_needs_no_first_message():
    group = FakeGroup()
    transport = _transport(group)
    specs = [(5000, torch.float32), (9 + TAIL, torch.float32)]
    _pass(transport, 2, specs, first_code=21)  # announced by a first message: 3 calls
    assert transport.pre_announced(specs)
    assert not transport.pre_announced(specs[:1])
    assert len(group.calls) == 3
    _pass(transport, 4, specs)  # announced by the pass before: its two all-reduces only
    assert group.calls[3:] == [("all_reduce", 5000), ("all_reduce", 9 + TAIL)]
    transport.forget_pre_announced()  # the buckets were rebuilt (every worker alike)
    assert not transport.pre_announced(specs)


def test_a_collective_between_passes_breaks_the_next_pass_announced_and_skips_an_offer():
    group = FakeGroup()
    transport = _transport(group)
    specs = [(5000, torch.float32), (9 + TAIL, torch.float32)]
    _pass(transport, 2, specs, first_code=21)
    transport.all_reduce_async(torch.ones(3), dist.ReduceOp.SUM, Signed(4, 99)).wait()  # a log line
    # zeros of the announced sizes (its mark says where it broke), then the collective's message
    assert group.calls[3:] == [("all_reduce", 5000), ("all_reduce", 9 + TAIL), ("all_reduce", FIRST)]
    assert transport.announces  # still announcing each pass
    _pass(transport, 6, specs, first_code=22)
    assert not transport.pre_announced(specs)  # this pass offered none
    _pass(transport, 9, specs, first_code=23)
    assert transport.pre_announced(specs)


def test_the_end_of_data_flag_rides_in_the_last_all_reduce_and_an_ended_input_announces_nothing():
    group = FakeGroup()
    transport = _transport(group)
    specs = [(5000, torch.float32), (9 + TAIL, torch.float32)]
    more, ended = DataFlag(True), DataFlag(False)
    transport.carry(more)
    assert more.agreed is None
    _pass(transport, 2, specs, first_code=21)
    assert more.agreed is True
    transport.carry(ended)
    _pass(transport, 4, specs)
    assert ended.agreed is False
    assert not transport.pre_announced(specs)  # the loop is over: whatever comes next needs no zeros
    short = [(5000, torch.float32), (10, torch.float32)]  # a tail of the break mark alone
    transport.carry(more := DataFlag(True))
    _pass(transport, 6, short, first_code=24, tail=1)
    assert more.agreed is None
    assert not transport.pre_announced(short)


def _signed(seq: int, tensor: torch.Tensor, kind: str = "all_reduce(SUM)") -> Signed:
    """As `CollectiveCheck.sign` signs it (the prediction needs the kind)."""
    return Signed(seq, code_of(seq, kind, tensor), Signature(seq, kind, "all_reduce", "test", ""))


def _repeat(transport, first_seq: int, times: int, numel: int = 3000) -> list[torch.Tensor]:
    tensors = [torch.full((numel,), float(i)) for i in range(times)]
    for i, tensor in enumerate(tensors):
        transport.all_reduce_async(tensor, dist.ReduceOp.SUM, _signed(first_seq + i, tensor)).wait()
    return tensors


def test_the_third_of_repeated_all_reduces_is_one_gloo_call_with_the_codes_after_the_tensor():
    group = FakeGroup()
    transport = _transport(group)
    tensors = _repeat(transport, 1, 4)
    rest = ("all_reduce", 3000 - (FIRST - 5))
    assert group.calls == [("all_reduce", FIRST), rest] * 2 + [("all_reduce", 3000 + 5)] * 2
    for i, tensor in enumerate(tensors):  # copied back out of the message: the one worker's own
        torch.testing.assert_close(tensor, torch.full((3000,), float(i)))


def test_a_large_repeated_all_reduce_goes_in_place_beside_a_message_of_the_codes():
    group = FakeGroup()
    transport = _transport(group)
    numel = PIPELINE_BYTES // 4
    _repeat(transport, 1, 4, numel)
    assert group.calls[-2:] != [("all_reduce", 5), ("all_reduce", numel)]  # 4 in a row first
    _repeat(transport, 5, 1, numel)
    assert group.calls[-2:] == [("all_reduce", 5), ("all_reduce", numel)]


def test_another_collective_after_repeats_breaks_the_prediction_with_zeros_and_goes_on():
    group = FakeGroup()
    transport = _transport(group)
    _repeat(transport, 1, 3)  # the third predicted: the fourth would be too
    transport.broadcast_async(torch.ones(2), 0, _signed(4, torch.ones(2), "broadcast(from 0)")).wait()
    # zeros of the predicted size with this worker's code (every worker broke: no mismatch), then
    # the broadcast's own first message
    assert group.calls[5:] == [("all_reduce", 3005), ("all_reduce", FIRST), ("broadcast", 2)]
    # it came true once: the next two runs of repeats predict nothing
    _repeat(transport, 5, 5)
    assert group.calls[8:] == [("all_reduce", FIRST), ("all_reduce", 3000 - (FIRST - 5))] * 4 + [
        ("all_reduce", 3005)
    ]


def test_repeats_unsigned_or_switched_off_predict_nothing():
    repeats = Repeats()
    flat = torch.ones(3000)
    for seq in (1, 2, 3):
        repeats.all_reduce(Signed(seq, 7), flat, dist.ReduceOp.SUM)  # no signature: no kind
    assert repeats.take() is None
    for seq in (4, 5):
        repeats.all_reduce(_signed(seq, flat), flat, dist.ReduceOp.SUM)
    assert repeats.predicted is not None
    assert repeats.predicted.code == code_of(6, "all_reduce(SUM)", flat)
    repeats.clear()
    assert repeats.take() is None
