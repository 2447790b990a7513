"""The gloo transport of `WorkerGroup`: signed collectives issued from the caller's thread.

Every signed collective starts with the *first message* of `phalanx.communication.transports.gloo.signed`
(a fixed size on every worker, whatever the collective, so gloo never meets two sizes and
aborts): an all-reduce that fits in it is that one gloo call; anything else (the rest of a
larger all-reduce, a broadcast, an all-gather) is a second gloo call *queued behind* the first
message and issued only once its codes matched. Every gloo call is issued in the order the
collectives were: on the caller's thread, under one lock, with the calls queued behind an
unverified first message going before any later call. Nothing waits on a thread of its own:
gloo's own threads move the bytes (overlapping with backward), and the waiter (or, for a
torch-facing work with callbacks, gloo's completion callback) verifies and issues what was
queued.

**Announced all-reduces.** The gradient buckets know, at the first launch of a backward
pass, every all-reduce of the pass (`GradientBuckets`): `GlooTransport.announce` sends one
header-only first message whose code covers them all (their sizes, dtypes and numbers), and
the announced all-reduces then go as single gloo calls with no first message of their own
(queued behind the announcement until it verified). One small message per backward pass
instead of one per bucket (announced only when some of them do not fit in a first message:
`GlooTransport.worth_announcing`). A worker that issues anything else while announced
all-reduces are still to come (a collective inside backward on one worker only, a backward
pass that raised) *breaks* the announcement: it sends zeros of each remaining announced size (so gloo
still meets equal sizes) and marks the last one; the last announced all-reduce reserves its
final element for that mark, so a worker that kept to the announcement sees the break in it
and raises before any result is used, and the breaking worker sees whether every worker
broke at the same point (then it goes on, and every worker stops announcing: a model that
makes collectives inside backward would otherwise pay the zeros every pass) or not (a
mismatch).

**The next pass announced by this one**. The last announced all-reduce of a pass
reserves `announced_tail` elements: each worker's code for the *next* pass's all-reduces (the
same sizes, numbered on from this pass's last), the input's end-of-data flag for the next step
(`DataFlag`, put there by the distributed iterator: whether this worker has data, and that it
carried one) and the break mark. When, after the sum, every worker offered the same code (and
the carried flags do not say the input ended), every worker holds the next pass as announced
and verified: its all-reduces go as one gloo call each with no first message at all, and a
loop over a distributed dataset makes no end-of-data all-reduce either. Anything else issued
first breaks it as above, on every worker alike or as a mismatch; a worker whose last pass is
still in flight waits for it first (so it knows whether the next pass was announced). After a
break at the start of a pass (a collective between passes: a barrier at an epoch's end, a log
line every step) a worker offers nothing for the next pass, or, while such breaks keep coming
within 8 passes of each other, for 2, 4, ... 1024 passes. A worker that offers nothing (code 0)
makes every worker go on as before: each decides from the same sums.

**Repeats.** An unannounced all-reduce every worker predicted (the last ones were the same) goes
as one gloo call, the codes after the tensor, or from 1 MiB two back to back, the codes beside
it: no round trip first (`phalanx.communication.transports.gloo.repeats`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx.communication.checks.collective_check import Signed, codes_after
from phalanx.communication.transports.gloo.announced import (
    KIND,
    Announced,
    DataFlag,
    Spec,
    announced_tail,
    pass_code,
)
from phalanx.communication.transports.gloo.repeats import Predicted, Repeats, repeat_messages
from phalanx.communication.transports.gloo.signed import (
    PIECES,
    Mismatch,
    code_pieces,
    codes_from,
    first_bytes,
    first_message,
)
from phalanx.communication.transports.gloo.works import Call, Header, SignedWork

__all__ = ["DataFlag", "GlooTransport", "SignedWork", "announced_tail"]  # SignedWork: what it returns

_MAX_SKIP, _NEAR = 1024, 8  # passes without an offer after a break between passes (at most); see `_break`


class GlooTransport:
    """A gloo group as a `WorkerGroup` transport (see the module doc); gloo's own works when
    the codes are off (``checked`` False).

    Args:
        group: The gloo group (a ``ProcessGroup`` or a gloo backend).
        rank, world: This worker and the number of workers.
        mismatch: The error of a collective whose code differs (`CollectiveCheck.mismatch`).
        keep: Holds gloo's own works until the group is torn down (`RecentWorks.add`).
        checked: Whether every worker signs its collectives.
        wait: ``wait(work, what)``: the group's watched wait (deadline, health), for the few
            places that must block before issuing (`WorkerGroup.wait`).
    """

    def __init__(
        self,
        group: Any,
        rank: int,
        world: int,
        mismatch: Mismatch,
        keep: Callable[[Any], Any],
        checked: bool,
        wait: Callable[[Any, str], None] | None = None,
    ) -> None:
        self.group, self._rank, self._world = group, rank, world
        self._mismatch, self._keep = mismatch, keep
        self.checked = checked
        self.announces = checked  # whether `announce` is worth calling (see `_break`)
        self._wait = wait or (lambda work, what: work.wait())
        self._lock = threading.RLock()
        self._gate: Header | None = None  # the first message the queued calls wait for
        self._queued: list[Call] = []
        self._announced: Announced | None = None
        self.pre_announces = checked  # whether the last all-reduce of a pass offers the next
        self._skip, self._backoff, self._passes = 0, 1, _MAX_SKIP  # passes: since the last break
        self._flag: DataFlag | None = None  # for the next pass's last all-reduce
        self._offered: Any = None  # the last all-reduce of a pass that offered the next (in flight)
        self._repeats = Repeats()  # repeated all-reduces (`phalanx.communication.transports.gloo.repeats`)
        self._options: dict[Any, Any] = {}  # AllreduceOptions by op

    # ---------------------------------------------------------------- ordering
    def _issue(self, start: Callable[[], Any], then: Callable[[Any], None] | None = None) -> Any:
        """Makes one gloo call after every call queued before it (first waits, outside the lock,
        for their first message to verify); ``then(work)`` runs under the same lock, right after.

        Raises:
            CollectiveMismatchError: The first message the queued calls waited for differs.
            PeerUnavailableError: (from ``wait``) a peer failed meanwhile.
        """
        while True:
            with self._lock:
                gate = self._gate
                if gate is None or gate.verified:
                    self.release(gate)
                    work = self._keep(start())
                    if then is not None:
                        then(work)
                    return work
            self._wait(gate.work, "the collective before this one")  # names a peer that failed
            gate.verify()

    def release(self, gate: Header | None) -> None:
        """Issues the calls queued behind ``gate`` once it verified (raises its mismatch)."""
        if gate is None:
            return
        with self._lock:
            if self._gate is not gate:
                return
            gate.verify()
            for call in self._queued:
                call.work = self._keep(call.start())
            self._queued.clear()
            self._gate = None

    def _behind(self, gate: Header, call: Call | None) -> Callable[[Any], None]:
        """``then`` of `_issue` for a first message: keeps its work, queues ``call`` behind it."""

        def then(work: Any) -> None:
            gate.work = work
            if call is not None:
                self._gate = gate
                self._queued.append(call)

        return then

    def _all_reduce_call(self, tensor: torch.Tensor, op: Any) -> Callable[[], Any]:
        options = self._options.get(op)
        if options is None:  # made once per op: gloo copies what it needs of them
            options = self._options[op] = dist.AllreduceOptions()
            options.reduceOp = op
        return lambda: self.group.allreduce([tensor], options)

    # ---------------------------------------------------------------- collectives (all workers)
    def all_reduce_async(self, tensor: torch.Tensor, op: Any, signed: Signed) -> Any:
        """Starts an in-place all-reduce of a contiguous tensor (all workers, same order)."""
        op = getattr(op, "op", op)
        if not (self.checked and signed.code):
            return self._keep(self._all_reduce_call(tensor, op)())
        self._settle()
        flat = tensor.view(-1)
        if self._resolve(signed):
            return self._repeat_all_reduce(flat, op, signed)
        with self._lock:
            announced = self._announced
            if announced is not None and announced.left and announced.left[0][2] == signed.code:
                return self._launch_announced(announced, tensor, signed)
        self._break(signed)
        if flat.dtype == torch.bool:  # gloo's bool reductions are logical: MAX is OR, MIN is AND
            staged = flat.to(torch.uint8)
            either = op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.BOR)
            return self._signed_all_reduce(
                staged,
                dist.ReduceOp.MAX if either else dist.ReduceOp.MIN,
                signed,
                lambda: flat.copy_(staged.bool()),
            )
        return self._signed_all_reduce(flat, op, signed)

    def _signed_all_reduce(
        self, flat: torch.Tensor, op: Any, signed: Signed, after: Callable[[], Any] | None = None
    ) -> SignedWork:
        header = Header(
            first_message(self._rank, self._world, signed, flat.dtype, op),
            signed,
            self._world,
            self._mismatch,
        )
        capacity = header.message.numel() - PIECES * self._world
        head = min(flat.numel(), capacity)
        with self._lock:
            if flat.numel() > capacity and after is None:
                self._repeats.all_reduce(signed, flat, op)
            else:
                self._repeats.other()
        header.message[:head].copy_(flat[:head])
        rest = Call(self._all_reduce_call(flat[capacity:], op)) if flat.numel() > capacity else None

        def finish() -> None:
            flat[:head].copy_(header.message[:head])
            if after is not None:
                after()

        self._issue(self._all_reduce_call(header.message, op), self._behind(header, rest))
        return SignedWork(self.release, header, rest, finish)

    # ---------------------------------------------------------------- repeats (`_gloo_repeats`)
    def _resolve(self, signed: Signed, all_reduce: bool = True) -> bool:
        """Before a signed collective: True when it is the all-reduce predicted to repeat
        (every worker predicted it; the last collective's codes verified). Otherwise breaks
        a prediction (raises unless every worker broke it)."""
        with self._lock:
            predicted = self._repeats.take()
            if not all_reduce:
                self._repeats.other()
            gate = self._gate
        if predicted is None:
            return False
        if gate is not None and not gate.verified:  # the history it was predicted from
            self._wait(gate.work, "the collective before this one")
        self.release(gate)
        if all_reduce and signed.code == predicted.code:
            return True
        self._break_repeat(predicted, signed)
        return False

    def _repeat_all_reduce(self, flat: torch.Tensor, op: Any, signed: Signed) -> SignedWork:
        """The predicted all-reduce with every worker's code in the same gloo call, or beside
        it; the next collective waits for the codes (the next prediction's history)."""
        header, call = self._repeat_calls(flat, op, signed, gate=True)
        if call is not None:
            return SignedWork(self.release, header, call)
        numel, staged = flat.numel(), header.message

        def finish() -> None:
            flat.copy_(staged[:numel])

        return SignedWork(self.release, header, None, finish)

    def _repeat_calls(self, flat: torch.Tensor, op: Any, signed: Signed, gate: bool) -> tuple[Header, Any]:
        message, message_op, beside = repeat_messages(flat, op, self._rank, self._world, signed.code)
        header = Header(message, signed, self._world, self._mismatch)
        call = None if beside is None else Call(self._all_reduce_call(beside, op))
        with self._lock:
            header.work = self._issue(self._all_reduce_call(message, message_op))
            if call is not None:
                call.work = self._issue(call.start)
            if gate:
                self._repeats.all_reduce(signed, flat, op)
                self._gate = header
        return header, call

    def _break_repeat(self, predicted: Predicted, signed: Signed) -> None:
        """Another collective than the predicted one: zeros of the predicted size with this
        worker's code; raises unless every worker's code is this one's."""
        zeros = torch.zeros(predicted.numel, dtype=predicted.dtype)
        header, _ = self._repeat_calls(zeros, predicted.op, signed, gate=False)
        self._wait(header.work, "the collective before this one")
        header.verify()
        with self._lock:
            self._repeats.broke()

    def _header_first(self, signed: Signed, body: Call) -> SignedWork:
        """A header-only first message, then ``body`` once it verified."""
        message = first_message(self._rank, self._world, signed, torch.float32, dist.ReduceOp.SUM)
        header = Header(message, signed, self._world, self._mismatch)
        self._issue(self._all_reduce_call(message, dist.ReduceOp.SUM), self._behind(header, body))
        return SignedWork(self.release, header, body)

    def broadcast_async(self, tensor: torch.Tensor, src: int, signed: Signed) -> Any:
        """Starts an in-place broadcast from worker ``src``."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        start = lambda: self.group.broadcast([tensor], options)  # noqa: E731
        if not (self.checked and signed.code):
            return self._keep(start())
        self._settle()
        self._resolve(signed, all_reduce=False)
        self._break(signed)
        return self._header_first(signed, Call(start))

    def all_gather_async(self, tensor: torch.Tensor, signed: Signed) -> tuple[Any, list[torch.Tensor]]:
        """Starts gathering every worker's contiguous tensor: the work and the list it fills."""
        out = [torch.empty_like(tensor) for _ in range(self._world)]
        start = lambda: self.group.allgather([out], [tensor])  # noqa: E731
        if not (self.checked and signed.code):
            return self._keep(start()), out
        self._settle()
        self._resolve(signed, all_reduce=False)
        self._break(signed)
        return self._header_first(signed, Call(start)), out

    # ---------------------------------------------------------------- announced all-reduces
    def worth_announcing(self, specs: Sequence[tuple[int, torch.dtype]]) -> bool:
        """Whether announcing these all-reduces saves gloo calls: some do not fit in a first
        message (those that fit are one call each anyway; the announcement is one more)."""
        if not self.announces:
            return False
        first, header = first_bytes(self._world), PIECES * self._world
        return any(n > first // d.itemsize - header for n, d in specs)

    def announce(self, signed: Signed, specs: Sequence[Spec], tail: int = 1) -> None:
        """Announces the next ``len(specs)`` collectives of this worker: SUM all-reduces of
        these sizes and dtypes, signed with these codes, the last one's final ``tail``
        elements reserved (1: the break mark; `announced_tail`: the next pass's announcement
        and the end-of-data flag too; see the module doc). ``signed``: the announcement's own
        code, which covers them (all workers, same order)."""
        if not (self.announces and signed.code) or not specs:
            return
        self._settle()
        self._resolve(signed, all_reduce=False)
        self._break(signed)
        message = first_message(self._rank, self._world, signed, torch.float32, dist.ReduceOp.SUM)
        header = Header(message, signed, self._world, self._mismatch)
        announced = Announced(header, specs, tail)

        def then(work: Any) -> None:
            header.work = work
            self._gate, self._announced = header, announced

        self._issue(self._all_reduce_call(message, dist.ReduceOp.SUM), then)
        # the queued all-reduces start as soon as it arrives (on gloo's thread, once per pass)
        header.work.get_future().add_done_callback(lambda _: self._on_arrival(header))

    def _on_arrival(self, header: Header) -> None:
        """Starts what waits for ``header`` (gloo's completion callback: never raises; a
        mismatch or gloo's error stays with the header for its waiters)."""
        with contextlib.suppress(BaseException):  # its waiters raise it
            self.release(header)

    def _launch_announced(self, announced: Announced, tensor: torch.Tensor, signed: Signed) -> SignedWork:
        """An announced all-reduce: one gloo call (queued while the announcement is unverified)."""
        announced.left.pop(0)
        announced.launched.append(signed)
        self._repeats.other()
        flat = tensor.view(-1)
        finish = None
        if not announced.left:  # the last: its final elements carry the break mark and the next pass
            self._announced = None
            tail = flat[flat.numel() - announced.tail :]
            self._write_tail(announced, tail, signed)
            finish = lambda: self._read_tail(announced, tail, signed)  # noqa: E731
        call = Call(self._all_reduce_call(flat, dist.ReduceOp.SUM))
        header = announced.header
        if self._gate is header and not header.verified and header.completed():
            header.verify()  # it arrived meanwhile (no wait): what was queued starts now
        if self._gate is header and not header.verified:
            self._queued.append(call)
        else:
            call.work = self._issue(call.start)
        work = SignedWork(self.release, header, call, finish)
        if announced.offered:
            self._offered = work
        return work

    # ---------------------------------------------------------------- the next pass, announced by this one
    def _write_tail(self, announced: Announced, tail: torch.Tensor, signed: Signed) -> None:
        """This worker's part of the last all-reduce's tail (see `announced_tail`): written in
        one copy (a backward pass's end waits for it)."""
        values = [0.0] * tail.numel()
        values[-1] = 1.0  # the break mark
        if len(values) >= announced_tail(self._world):
            flag, self._flag = self._flag, None
            announced.flag = flag
            if flag is not None:
                values[-3], values[-2] = float(flag.has_data), 1.0
            offer = self.pre_announces and self._skip == 0 and (flag is None or flag.has_data)
            self._skip, self._passes = max(self._skip - 1, 0), self._passes + 1
            if offer:
                announced.next_codes = codes_after(signed.seq, KIND, [(n, d) for n, d, _ in announced.specs])
                announced.offered = pass_code(announced.next_codes)
                at = self._rank * PIECES
                values[at : at + PIECES] = code_pieces(announced.offered)
        tail.copy_(torch.tensor(values, dtype=tail.dtype))

    def _read_tail(self, announced: Announced, tail: torch.Tensor, signed: Signed) -> None:
        """After the last all-reduce's sum: the break mark, the end-of-data flags, and the
        next pass announced when every worker offered the same (all workers decide alike)."""
        values = tail.tolist()  # a few elements: Python, not torch ops
        self._check_mark(announced, values[-1])
        if len(values) < announced_tail(self._world):
            return
        has_data, carried = values[-3], values[-2]
        ended = carried == self._world and has_data == 0
        if announced.flag is not None and carried == self._world:
            announced.flag.agreed = has_data > 0
        if not announced.offered or ended:
            return
        if any(code != announced.offered for code in codes_from(values[: PIECES * self._world], self._world)):
            return
        header = Header(torch.empty(0), signed, self._world, self._mismatch)
        header.verified = True  # by this all-reduce's sum
        specs = [(n, d, c) for (n, d, _), c in zip(announced.specs, announced.next_codes, strict=True)]
        with self._lock:
            if self._announced is None:
                self._announced = Announced(header, specs, announced.tail, pre=True)

    def _settle(self) -> None:
        """Before issuing anything: waits for the pass that offered the next one, if still
        running, so this worker knows (as every worker will) whether it was announced."""
        offered, self._offered = self._offered, None
        if offered is None:
            return
        if offered.is_completed():  # the usual case (the pass's end waited for it): no watched wait
            with contextlib.suppress(BaseException):  # it failed: the watched wait says why
                offered.wait()
                return
        self._wait(offered, "the gradient all-reduces")

    def pre_announced(self, specs: Sequence[tuple[int, torch.dtype]]) -> bool:
        """Whether the last pass announced these all-reduces as the next (then the pass needs
        no announcement of its own)."""
        self._settle()
        with self._lock:
            announced = self._announced
            return (
                announced is not None
                and announced.pre
                and len(announced.left) == announced.total
                and [(n, d) for n, d, _ in announced.left] == list(specs)
            )

    def forget_pre_announced(self) -> None:
        """Drops the next pass announced by the last one: its all-reduces changed (the
        buckets were rebuilt on what every worker's flags said: all workers alike)."""
        self._settle()
        with self._lock:
            announced = self._announced
            if announced is not None and announced.pre and len(announced.left) == announced.total:
                self._announced = None

    def carry(self, flag: DataFlag) -> None:
        """Puts this worker's end-of-data flag for the next step in the next last all-reduce
        of a pass (replacing one not carried yet)."""
        self._flag = flag

    def set_checked(self, on: bool) -> None:
        """Turns the codes on or off (measurement: every worker alike, between passes)."""
        self._settle()
        with self._lock:
            self.checked = self.announces = self.pre_announces = on
            self._announced, self._skip = None, 0
            self._repeats.clear()

    def _check_mark(self, announced: Announced, mark: float) -> None:
        """After the last announced all-reduce: 1 from every worker unless one broke."""
        if mark == self._world:
            return
        at = int(mark) - self._world - 1  # where the (one) breaking worker left the announcement
        signed = announced.launched[at] if 0 <= at < announced.total else announced.launched[-1]
        raise self._mismatch(signed, None)

    def _break(self, signed: Signed) -> None:
        """Before an unannounced collective: zeros for every announced all-reduce still to
        come, the last marked; raises unless every worker broke at the same point."""
        with self._lock:
            announced, self._announced = self._announced, None
        if announced is None or not announced.left:
            return
        at = announced.total - len(announced.left)
        zeros = [torch.zeros(numel, dtype=dtype) for numel, dtype, _ in announced.left]
        zeros[-1][-1] = 2 + at
        works = [self._issue(self._all_reduce_call(z, dist.ReduceOp.SUM)) for z in zeros]
        self._wait(works[-1], "the announced all-reduces")
        if float(zeros[-1][-1]) != self._world * (2 + at):
            raise self._mismatch(signed, None)
        if announced.pre and at == 0:  # a collective between passes: offer none for a while,
            # longer each time if they come soon after (a log line every step: rarely worth it)
            near = self._passes <= self._backoff + _NEAR
            self._backoff = min(2 * self._backoff, _MAX_SKIP) if near else 1
            self._skip, self._passes = self._backoff, 0
            return
        # every worker broke here: a collective inside backward, most likely in every pass, so
        # every worker stops announcing (each gradient all-reduce has its own first message)
        self.announces = False

    def close(self, timeout: float = 5.0) -> None:
        """Forgets what is queued (nothing runs on a thread of its own; ``timeout`` unused)."""
        with self._lock:
            self._queued.clear()
            self._gate, self._announced = None, None
            self._offered, self._flag = None, None
            self._repeats.clear()
