"""GradientBuckets start in order only the buckets some worker is predicted to write to: two
workers on two threads of this process, each with its own engine, meeting in a real in-process
all-reduce."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
from torch import nn

from phalanx.communication.engine.bucketing import GradientBuckets

WORKERS = 2


class Exchange:
    """An all-reduce between the workers' threads: the i-th call of every worker meets the
    i-th call of the others (a mismatch of sizes fails the test, as gloo would abort)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._posted: dict[int, list[torch.Tensor]] = {}
        self.launched: list[list[int]] = [[] for _ in range(WORKERS)]  # sizes, per worker

    def launcher(self, rank: int) -> Callable[[torch.Tensor], Callable[[], None]]:
        def launch(buffer: torch.Tensor) -> Callable[[], None]:
            seq = len(self.launched[rank])
            self.launched[rank].append(buffer.numel())
            with self._cond:
                self._posted.setdefault(seq, []).append(buffer.clone())
                self._cond.notify_all()

            def wait() -> None:
                with self._cond:
                    assert self._cond.wait_for(lambda: len(self._posted[seq]) == WORKERS, timeout=30)
                    parts = self._posted[seq]
                assert len({p.numel() for p in parts}) == 1, f"call {seq}: sizes {[p.numel() for p in parts]}"
                buffer.copy_(sum(parts))

            return wait

        return launch


class Pair(nn.Module):
    """Two models in one scope: ``a`` trains every step, ``b`` only when asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.b = nn.Sequential(nn.Linear(6, 40), nn.Linear(40, 3))  # sizes of its own
        self.a = nn.Sequential(nn.Linear(6, 32), nn.Linear(32, 3))


def _workers(announced: list[list] | None = None) -> tuple[list[Pair], list[GradientBuckets], Exchange]:
    exchange = Exchange()
    nets = [Pair() for _ in range(WORKERS)]
    engines = []
    for rank, net in enumerate(nets):
        told = announced if rank == 0 else []  # worker 0's are the ones checked
        kwargs = {} if announced is None else {"announce": told.append, "announce_tail": 1}
        engine = GradientBuckets(
            exchange.launcher(rank), lambda work, what: work(), workers=WORKERS, solo_bytes=256, **kwargs
        )
        for p in net.parameters():
            engine.add(p)
        engines.append(engine)
    return nets, engines, exchange


def _step(nets: list[Pair], uses_b: Callable[[int], bool], seed: int) -> list[torch.Tensor | None]:
    """One backward pass on every worker at once (``uses_b(rank)``: whether that worker's loss
    goes through ``b`` too); returns what one device would hold for b's first weight."""
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + r)) for r in range(WORKERS)]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            net = nets[rank]
            loss = net.a(xs[rank]).sum()
            if uses_b(rank):
                loss = loss + net.b(xs[rank]).square().sum()
            loss.backward()
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    reference = copy.deepcopy(nets[0])
    reference.zero_grad(set_to_none=True)
    for r in range(WORKERS):
        loss = reference.a(xs[r]).sum()
        if uses_b(r):
            loss = loss + reference.b(xs[r]).square().sum()
        loss.backward()
    return [p.grad for p in reference.parameters()]


def _check(nets: list[Pair], want: list[torch.Tensor | None]) -> None:
    for net in nets:
        for p, w in zip(net.parameters(), want, strict=True):
            assert (p.grad is None) is (w is None)
            if w is not None:
                torch.testing.assert_close(p.grad, w)
        net.zero_grad(set_to_none=True)


def _sizes(engine: GradientBuckets, model: nn.Module) -> set[int]:
    """The sizes of the buckets holding ``model``'s parameters."""
    mine = {id(p) for p in model.parameters()}
    return {sum(p.numel() for p in b) for b in engine.buckets if any(id(p) in mine for p in b)}


def _rounds(nets, exchange, uses_b: list[bool]) -> list[list[int]]:
    """Runs one step per entry of ``uses_b`` (whether both workers go through ``b``), checking
    the sums; returns worker 0's launched sizes, per step."""
    per_step = []
    for step, through_b in enumerate(uses_b):
        before = len(exchange.launched[0])
        _check(nets, _step(nets, lambda rank, b=through_b: b, seed=10 * step))
        per_step.append(exchange.launched[0][before:])
    assert exchange.launched[0] == exchange.launched[1]
    return per_step


def test_a_model_no_worker_trains_stops_costing_all_reduces_after_one_round():
    nets, engines, exchange = _workers()
    b_only = _sizes(engines[0], nets[0].b) - _sizes(engines[0], nets[0].a)
    assert b_only == {240, 120}  # b's weights are solo buckets
    first, *later = _rounds(nets, exchange, [False] * 4)
    assert b_only <= set(first)  # the first round after a build expects every bucket
    for launched in later:
        assert not b_only & set(launched)  # b's own buckets no longer move
        assert len(launched) == len(first) - len(b_only)


def test_a_loop_that_switches_models_sends_the_old_ones_zeros_once_and_the_new_ones_late_once():
    nets, engines, exchange = _workers()
    b_only = _sizes(engines[0], nets[0].b) - _sizes(engines[0], nets[0].a)
    in_order, *_ = _rounds(nets, exchange, [True] * 4)
    alone = [n for n in in_order if n not in b_only]
    # b's loop stops: its zeros go once more, in order; then nothing of b
    assert _rounds(nets, exchange, [False] * 3) == [in_order, alone, alone]
    # b's loop comes back: b is summed after the round's own once (late), then in order
    back, *after = _rounds(nets, exchange, [True] * 3)
    assert back[: len(alone)] == alone
    assert sorted(back[len(alone) :]) == sorted(b_only)
    assert after == [in_order, in_order]


def test_passes_that_alternate_between_two_sets_keep_both_in_order():
    nets, engines, exchange = _workers()
    b_only = _sizes(engines[0], nets[0].b) - _sizes(engines[0], nets[0].a)
    per_step = _rounds(nets, exchange, [True, False] * 5)
    in_order = per_step[0]
    alone = [n for n in in_order if n not in b_only]
    # once four rounds show the alternation, b goes in order in the passes that write to it
    # and not at all in the others: neither zeros nor a late exchange
    assert per_step[4:] == [in_order, alone] * 3


def test_a_worker_that_writes_to_a_bucket_not_expected_has_it_summed_on_every_worker():
    nets, engines, exchange = _workers()
    _rounds(nets, exchange, [False] * 2)  # now b is not expected
    before = len(exchange.launched[0])
    # only worker 1 goes through b: worker 0 learns it from the flags and sends zeros for it
    _check(nets, _step(nets, lambda rank: rank == 1, seed=3))
    late = exchange.launched[0][before:]
    b_sizes = _sizes(engines[0], nets[0].b) - _sizes(engines[0], nets[0].a)
    assert b_sizes <= set(late[-len(b_sizes) :])  # after the round's own, in order
    # the next round expects b (launched in order) and gets it right with both workers in it
    _check(nets, _step(nets, lambda rank: True, seed=4))
    _check(nets, _step(nets, lambda rank: rank == 0, seed=5))
    assert exchange.launched[0] == exchange.launched[1]


def test_a_change_of_the_expected_buckets_is_a_new_pass_for_the_announcement():
    announced: list[list] = []
    nets, engines, exchange = _workers(announced)
    _rounds(nets, exchange, [False] * 4)
    # a new layout ([]), pass 1 with every bucket; a new set ([]), passes 2 to 4 without b's
    assert [len(specs) for specs in announced] == [0, 5, 0, 3, 3, 3]
    assert announced[3] == announced[4] == announced[5]
