"""The backward rounds every strategy's gradient sum runs on, with a stage that records."""

from __future__ import annotations

import pytest
import torch

from phalanx.communication.engine.rounds import Round, Rounds


class Stage:
    def __init__(self) -> None:
        self.opened: list[int] = []
        self.deltas: list[tuple[int, str]] = []
        self.ended: list[tuple[dict, set]] = []

    def on_end(self, index: int, state: Round) -> None:
        self.ended.append(
            ({k: None if b is None else b.clone() for k, b in state.bases.items()}, state.accumulated)
        )


def _hooked(active=lambda: True, syncing=lambda: True):
    stage = Stage()
    rounds = Rounds(
        1,
        stage.on_end,
        active,
        on_open=stage.opened.append,
        on_delta=lambda index, slot, leaf: stage.deltas.append((index, slot)),
        syncing=syncing,
    )
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    rounds.hook(a, 0, ["a"])
    rounds.hook(b, 0, ["b"])
    return rounds, stage, a, b


def test_a_round_moves_each_grad_aside_once_and_hands_the_stage_every_delta():
    rounds, stage, a, b = _hooked()
    a.grad = torch.full((2,), 5.0)
    (a * 2 + a).sum().backward()  # a is reached twice: its base moves once
    assert stage.opened == [0]
    assert stage.deltas == [(0, "a")]
    bases, accumulated = stage.ended[0]
    assert accumulated == {"a"}
    torch.testing.assert_close(bases["a"], torch.full((2,), 5.0))
    torch.testing.assert_close(a.grad, torch.full((2,), 3.0))  # the delta; the stage installs the sum
    assert b.grad is None


def test_autograd_grad_and_a_failed_backward_give_the_bases_back():
    rounds, stage, a, b = _hooked()
    a.grad = torch.full((2,), 7.0)
    torch.autograd.grad((a * 2).sum(), [a])
    torch.testing.assert_close(a.grad, torch.full((2,), 7.0))
    assert stage.ended == []

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    b.grad = torch.full((2,), 4.0)
    out = (a * 2).sum() + (b * 3).sum()
    b.register_hook(boom)  # after the rounds' hook: b's base has moved aside when it raises
    with pytest.raises(ValueError, match="boom"):
        out.backward()
    rounds.abort()
    torch.testing.assert_close(a.grad, torch.full((2,), 7.0))
    torch.testing.assert_close(b.grad, torch.full((2,), 4.0))
    assert stage.ended == []


def test_backward_passes_outside_the_active_window_change_nothing():
    active = [False]
    rounds, stage, a, _ = _hooked(lambda: active[0])
    (a * 2).sum().backward()
    assert stage.opened == []
    assert stage.deltas == []
    assert stage.ended == []
    torch.testing.assert_close(a.grad, torch.full((2,), 2.0))  # autograd's own accumulation
    del rounds


def test_accumulate_only_rounds_tell_the_stage_nothing_and_the_next_round_hands_it_every_pending_sum():
    syncing = [False]
    rounds, stage, a, b = _hooked(syncing=lambda: syncing[0])
    a.grad = torch.full((2,), 5.0)  # what the last synchronised round left
    (a * 2).sum().backward()
    (a * 3 + b * 4).sum().backward()
    assert (stage.opened, stage.deltas, stage.ended) == ([], [], [])
    assert rounds.holds(0)
    torch.testing.assert_close(a.grad, torch.full((2,), 5.0))  # the pending local sum: 2 + 3
    torch.testing.assert_close(b.grad, torch.full((2,), 4.0))
    syncing[0] = True
    (a * 10).sum().backward()  # b is not reached: its pending sum still goes to the stage
    assert stage.opened == [0]
    assert sorted(stage.deltas) == [(0, "a"), (0, "b")]
    bases, accumulated = stage.ended[0]
    assert accumulated == {"a", "b"}
    torch.testing.assert_close(bases["a"], torch.full((2,), 5.0))  # the held base, summed once before
    assert bases["b"] is None
    torch.testing.assert_close(a.grad, torch.full((2,), 15.0))  # pending + this pass's delta
    torch.testing.assert_close(b.grad, torch.full((2,), 4.0))
    assert not rounds.holds(0)


def test_an_accumulate_only_pass_that_accumulated_nothing_or_failed_gives_its_gradients_back():
    rounds, stage, a, b = _hooked(syncing=lambda: False)
    a.grad = torch.full((2,), 7.0)
    torch.autograd.grad((a * 2).sum(), [a])
    torch.testing.assert_close(a.grad, torch.full((2,), 7.0))
    assert not rounds.holds(0)

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    b.grad = torch.full((2,), 4.0)
    out = (b * 3).sum()
    b.register_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        out.backward()
    rounds.abort()
    torch.testing.assert_close(b.grad, torch.full((2,), 4.0))
    assert not rounds.holds(0)
    assert stage.ended == []
