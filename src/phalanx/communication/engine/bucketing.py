"""DDP-style gradient buckets: all-reduce gradients while backward is still running.

Used by MultiWorkerMirroredStrategy with one local replica, where parameters stay plain
``nn.Parameter``s. The parameters a worker created in the strategy's scope are grouped into
buckets in *reverse registration order* (about the order backward produces their gradients,
and the same on every worker because every worker builds the same model): the first bucket
holds about ``first_bucket_bytes`` (1 MiB, so the last layers' gradients start moving early),
the others about ``bucket_bytes`` (25 MiB), one dtype and device per bucket, as DDP does.
A gradient of at least ``solo_bytes`` (1 MiB) is a bucket of its own, all-reduced where
autograd put it: DDP's reducer copies every gradient into its bucket and (without
``gradient_as_bucket_view``) back out; here the large ones, nearly all the bytes of a
model, are copied neither way, and the small ones are copied in once and their ``.grad``
is a view of the bucket afterwards.

One backward pass is one *round*; at its end every parameter's ``.grad`` holds the sum over
workers (DDP's contract: reads and in-place edits between ``backward()`` and
``optimizer.step()``, such as clipping or unscaling, act on the sum, and the step applies
what ``.grad`` holds):

* Before autograd accumulates into a parameter (a tensor hook), its current ``.grad`` is
  moved aside as the round's *base*, so autograd writes this pass's contribution (the
  *delta*) into a fresh tensor.
* When a parameter's delta has been accumulated (``register_post_accumulate_grad_hook``),
  it is copied into its bucket (a solo bucket takes it as it is); when every delta of a
  bucket is in, the bucket's all-reduce starts asynchronously. Buckets start strictly in
  index order on every worker, so the collectives match across workers.
* At the end of the backward pass (an autograd-engine callback, as DDP's) each parameter
  this pass did not reach contributes zeros, every remaining bucket starts, and the pass
  waits for all of them: each parameter's ``.grad`` becomes its base plus the sum of the
  deltas (a view of its bucket when there was no base). So each round issues the same
  all-reduces on every worker, whatever the data did, and gradient accumulation (several
  backward passes before one step) sums deltas: ``sum(d1) + sum(d2)``.
* The last bucket of the launch order (always a packed one, if need be of flags alone)
  also carries one "has a delta" flag per parameter of every bucket; after the sum, a
  parameter that no worker has a delta for keeps its ``.grad`` untouched (None after
  ``zero_grad()``), as on one device. A pass that accumulated nothing
  (``torch.autograd.grad``) puts the bases back and starts no all-reduce.
* Only the buckets some worker is predicted to write to are *expected* (start in order during
  backward), with the flags' bucket, which then starts at the pass's end. The prediction is
  the last pass's answer (some worker wrote to it), unless the last four passes alternate
  (a GAN's discriminator step, then a generator step through both): then the answer of two
  passes back. Every worker reads the same sums, so every worker expects the same buckets.
  A second model in the scope that this loop never trains (``fit``'s beside a custom
  loop's) costs its flags, not its bytes, after one pass, as in TF, where only the gradients
  a step applies are all-reduced. A bucket that was not expected but that some worker wrote
  to after all (the flags say so) starts after the others, on every worker, before anything
  is installed: a surprise costs one more exchange, never a wrong sum. The first round after the buckets
  are built expects them all.
* A parameter that died (its model was dropped) keeps its slot, as zeros, until every
  worker has dropped it: the last bucket also carries one "dead here" flag per parameter, and
  once their sum says every worker's copy is dead, every worker forgets the slot at the
  same round and the buckets are rebuilt without it. So a process that builds model after
  model under one strategy does not all-reduce the dead ones' zeros forever.
* Sparse gradients (``nn.Embedding(sparse=True)``) cannot go in a bucket, as in DDP: the
  first time one arrives its bucket slot carries zeros and a "sparse" flag, so after that
  round every worker knows, and the buckets are rebuilt without it. Sparse deltas are
  summed at the end of the round, after the buckets, one parameter at a time in
  registration order, by ``sum_sparse`` (which gathers every worker's indices and values).
* With a compressor (`phalanx.communication.compression`), each bucket's all-reduce goes
  through it, except the one that carries the flags (exact counts). Under ``"fp16"`` or
  ``"bf16"`` they ride in the last packed bucket, which then goes uncompressed, when its
  gradients are at most ``flags_ride_bytes`` (64 KiB: biases and norms): sending those few
  gradients at twice the width costs less than one more all-reduce after backward, whose
  round trip a slow link charges in full. Otherwise (a larger last bucket, or PowerSGD, which
  shrinks even a small matrix 10-fold) they travel in a bucket of their own. A pass
  is announced where the compressor is `predictable` (``"fp16"``/``"bf16"``: one all-reduce
  per bucket in the wire's dtype), not otherwise (PowerSGD's depend on its matrices). A
  rebuild of the buckets resets the compressor's state (its error feedback is per bucket).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from phalanx.communication.compression.base import CompressedAllReduce, Compressor
from phalanx.communication.engine.bucket import Bucket
from phalanx.communication.engine.rounds import Round, Rounds
from phalanx.communication.local.sparse import SPARSE, empty_sparse, plus

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "FLAGS_RIDE_BYTES",
    "SOLO_BYTES",
    "GradientBuckets",
]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024
SOLO_BYTES = 1024 * 1024  # a gradient this large is all-reduced where autograd put it
_ALTERNATING = (0b0101, 0b1010)  # the last four passes' writes (bit 0: the last) of a period of two
FLAGS_RIDE_BYTES = 64 * 1024  # under fp16/bf16, a last bucket this small carries the flags, uncompressed
_FLAG_DTYPES = (torch.float32, torch.float64)  # hold the flags' counts exactly

Launch = Callable[[torch.Tensor], Any]  # starts an async in-place SUM all-reduce, returns its work
Wait = Callable[[Any, str], None]  # waits for that work (raises on failure)
# tells every launch of a round (element count, dtype) before the first: `WorkerGroup.announce_all_reduces`
Announce = Callable[[list[tuple[int, torch.dtype]]], None]


class GradientBuckets:
    """Overlapped, bucketed gradient all-reduce for the parameters one worker created in scope.

    Args:
        launch: ``launch(buffer) -> work`` starts an async in-place SUM all-reduce.
        wait: ``wait(work, what)`` waits for it with the strategy's deadline and health check.
        sum_sparse: ``sum_sparse(sparse) -> sparse`` sums a sparse COO tensor across workers
            (all workers; blocks). Default: the identity (one worker).
        workers: How many workers sum (a slot is forgotten once it died on all of them).
        is_active: Whether a backward pass belongs to the strategy (runs inside its ``run``);
            hooks of other backward passes do nothing.
        bucket_bytes: Bucket size (0: 25 MiB).
        first_bucket_bytes: Size of the first bucket (default 1 MiB, capped at ``bucket_bytes``).
        solo_bytes: A gradient of at least this size (default 1 MiB, capped at
            ``bucket_bytes``) is its own bucket, all-reduced in place: no copy.
        announce: ``announce(specs)`` is told every all-reduce of a round (element count and
            dtype, in launch order) just before the first starts; the last bucket then
            leaves its final ``announce_tail`` elements to the transport (the gloo transport's
            check of announced all-reduces). ``announce([])`` at the first hook of a pass
            whose all-reduces differ from the last pass's (the buckets were rebuilt; all
            workers alike). None: no announcement, no extra element.
        announce_tail: How many elements the last bucket leaves to ``announce``'s transport.
        wait_at_end: ``wait`` for the end of a backward pass, which waits inside the backward
            call that issued the all-reduces (the group names the issuing site as where it
            waits: no second walk of the stack). Default: ``wait``.
        syncing: Whether a pass opening now all-reduces (False: it only accumulates locally
            and the next pass that syncs sums it, `phalanx.communication.engine.rounds`).
        compressor: Compresses the buckets' all-reduces (None: float as they are).
        flags_ride_bytes: With a `Compressor.predictable` compressor (fp16, bf16), the flags
            ride (uncompressed) in the last packed bucket when its gradients are at most this
            many bytes; else, and under any other compressor, they go alone.
    """

    def __init__(
        self,
        launch: Launch,
        wait: Wait,
        is_active: Callable[[], bool] = lambda: True,
        bucket_bytes: int = 0,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        sum_sparse: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        workers: int = 1,
        solo_bytes: int = SOLO_BYTES,
        announce: Announce | None = None,
        announce_tail: int = 1,
        wait_at_end: Wait | None = None,
        syncing: Callable[[], bool] = lambda: True,
        compressor: Compressor | None = None,
        flags_ride_bytes: int = FLAGS_RIDE_BYTES,
    ) -> None:
        self._wait, self._is_active = wait, is_active
        self._traffic = CompressedAllReduce(launch, compressor)
        self._wait_at_end = wait_at_end or wait
        self._announce = announce if compressor is None or compressor.predictable else None
        self._tail = announce_tail if self._announce is not None else 0
        self._new_plan = False  # the next pass's all-reduces differ from the last's (tell `announce`)
        self._announced = False  # this pass's all-reduces were announced
        self._sum_sparse = sum_sparse
        self._workers = workers
        self._bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        self._first_bytes = min(first_bucket_bytes, self._bucket_bytes)
        self._solo_bytes = min(solo_bytes, self._bucket_bytes)
        self._ride_bytes = flags_ride_bytes
        self._params: list[weakref.ref[torch.nn.Parameter]] = []  # trainable, registration order
        self._layout: list[tuple[torch.Size, torch.dtype, torch.device]] = []  # of each, kept after it dies
        self._is_sparse: list[bool] = []  # of each: its gradients are sparse (not in a bucket)
        self._sparse_deltas: dict[int, torch.Tensor] = {}  # id(param) -> its sparse delta this round
        self._frozen: list[weakref.ref[torch.nn.Parameter]] = []  # requires_grad=False when added
        # id -> the parameter: a dead one's id may be reused by a new parameter
        self._ids: dict[int, weakref.ref[torch.Tensor]] = {}
        self._handles: list[Any] = []
        self._buckets: list[Bucket] | None = None
        self._where: dict[int, tuple[int, int]] = {}
        self._next_launch = 0
        self._bases: dict[int, torch.Tensor | None] = {}  # id(param) -> .grad moved aside (at the end)
        self._lock = threading.RLock()
        # the round engine of every strategy's gradient sum; a parameter's slot is its id
        self._rounds = Rounds(
            1, self._end_round, is_active, on_open=self._start_round, on_delta=self._on_grad, syncing=syncing
        )

    # ---------------------------------------------------------------- registration
    def add(self, param: torch.nn.Parameter) -> None:
        """Tracks a parameter created in the strategy's scope (same order on every worker).

        A parameter that does not require a gradient yet is tracked from the first `refresh`
        after it does (each ``run`` refreshes).
        """
        if self.tracks(param):
            return  # shared by two modules (tied weights)
        with self._lock:
            self._ids[id(param)] = weakref.ref(param)
            if param.requires_grad:
                self._track(param)
            else:
                self._frozen.append(weakref.ref(param))

    def _track(self, param: torch.nn.Parameter) -> None:
        ref = weakref.ref(param)
        self._params.append(ref)
        self._layout.append((param.shape, param.dtype, param.device))
        self._is_sparse.append(False)
        self._handles.extend(self._rounds.hook(param, 0, [id(param)]))
        self._buckets = None  # rebuilt at the next round

    def refresh(self) -> None:
        """Starts tracking frozen parameters that now require a gradient (before each run)."""
        if not self._frozen:
            return
        with self._lock:
            still = []
            for ref in self._frozen:
                p = ref()
                if p is not None and p.requires_grad:
                    self._track(p)
                elif p is not None:
                    still.append(ref)
            self._frozen = still

    def holds(self) -> bool:
        """Whether accumulate-only passes left deltas no pass has all-reduced yet."""
        return self._rounds.holds(0)

    def tracks(self, param: torch.Tensor) -> bool:
        """Whether ``param`` was added (created in the strategy's scope)."""
        known = self._ids.get(id(param))
        return known is not None and known() is param

    @property
    def buckets(self) -> list[list[torch.Tensor]]:
        """The parameters of each bucket, in launch order (built on first use)."""
        with self._lock:
            return [b.params for b in self._ensure_built() if b.params]

    @property
    def traffic(self) -> CompressedAllReduce:
        """Bytes handed to all-reduces so far, and the compressor (its state: `reset_compression`)."""
        return self._traffic

    def reset_compression(self) -> None:
        """Forgets the compressor's error feedback and warm starts (all workers alike: a
        checkpoint restore)."""
        with self._lock:
            self._traffic.reset()

    def _ensure_built(self) -> list[Bucket]:
        if self._buckets is None:
            self._flush_running()
            self._traffic.reset()  # its state is per bucket
            self._buckets = self._build()
            self._new_plan = True
            self._next_launch = 0
        return self._buckets

    def _build(self) -> list[Bucket]:
        """Buckets in launch order; the last one is packed and carries every bucket's flags."""
        groups: list[tuple[list[torch.Tensor], list[int], torch.device, torch.dtype, bool]] = []
        open_: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int], int]] = {}
        started: set[tuple[torch.device, torch.dtype]] = set()
        for k in reversed(range(len(self._params))):
            if self._is_sparse[k]:
                continue
            p = self._member(k)
            key = (self._layout[k][2], p.dtype)
            nbytes = p.numel() * p.element_size()
            if nbytes >= self._solo_bytes:
                groups.append(([p], [k], *key, True))
                continue
            members, slots, size = open_.get(key, ([], [], 0))
            limit = self._bucket_bytes if key in started else self._first_bytes
            if members and size + nbytes > limit:
                groups.append((members, slots, *key, False))
                started.add(key)
                members, slots, size = [], [], 0
            open_[key] = ([*members, p], [*slots, k], size + nbytes)
        groups.extend((members, slots, *key, False) for key, (members, slots, _) in open_.items() if members)
        compressor = self._traffic.compressor
        # a compressed bucket carries no flags; under fp16/bf16 a small last one goes wide with them
        ride = 0 if compressor is None else self._ride_bytes if compressor.predictable else -1
        if groups and (
            groups[-1][4]  # a solo bucket is the gradient itself: no room after it
            or groups[-1][3] not in _FLAG_DTYPES
            or (compressor is not None and sum(p.numel() * p.element_size() for p in groups[-1][0]) > ride)
        ):
            groups.append(([], [], groups[-1][2], torch.float32, False))  # the flags alone
        flags = 2 * sum(len(group[0]) for group in groups)
        tail = self._tail
        last = len(groups) - 1
        buckets = [
            Bucket(members, slots, dtype, device, solo, flags if b == last else 0, tail if b == last else 0)
            for b, (members, slots, device, dtype, solo) in enumerate(groups)
        ]
        self._where = {id(p): (b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket.params)}
        return buckets

    def _member(self, k: int) -> torch.Tensor:
        """Slot ``k``'s parameter, or a "meta" placeholder of its layout once it died."""
        p: torch.Tensor | None = self._params[k]()
        if p is None:
            shape, dtype, device = self._layout[k]
            return torch.empty(shape, dtype=dtype, device="meta")
        # live: its layout now (model.double() or .to() may have run since it was added)
        self._layout[k] = (p.shape, p.dtype, p.device)
        return p

    # ---------------------------------------------------------------- during backward
    def _on_grad(self, index: int, slot: int, param: torch.Tensor) -> None:
        """Autograd accumulated this pass's delta into ``param``: into its bucket; start the
        buckets that are complete, in order."""
        with self._lock:
            buckets = self._ensure_built()
            grad = param.grad
            where = self._where.get(id(param))
            if grad is not None and grad.is_sparse:
                self._sparse_deltas[id(param)] = grad
                if where is not None:  # the first sparse delta: tell every worker
                    buckets[where[0]].put_sparse(where[1])
                    self._launch_ready(buckets)
                return
            if where is None:
                raise RuntimeError(
                    "A parameter whose gradients were sparse received a dense gradient; its "
                    "sum across workers expects sparse ones. Received: a dense gradient for a "
                    f"parameter of shape {tuple(param.shape)}. HINT: keep nn.Embedding(sparse=...) "
                    "fixed for the whole training."
                )
            b, i = where
            bucket = buckets[b]
            if bucket.work is not None:
                raise RuntimeError(
                    "A parameter received a second gradient in one backward pass after its "
                    "bucket's all-reduce had started, so the sum would miss it. This happens "
                    "when a parameter is used both inside and outside a reentrant activation "
                    "checkpoint. Received: a second gradient for a parameter of shape "
                    f"{tuple(param.shape)} (bucket {b}). HINT: use "
                    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
                )
            bases = self._rounds.state(index).bases
            base = bases.get(slot)
            if base is not None and bucket.owns(base):  # the last sum: its slot gets overwritten
                bases[slot] = base.clone()
            bucket.put(i, grad)
            self._launch_ready(buckets)

    def _start_round(self, index: int) -> None:
        """First hook of a backward pass: wait for anything still running."""
        with self._lock:
            buckets = self._ensure_built()
            self._flush_running()
            if self._new_plan and self._announce is not None:
                self._announce([])  # at the same point on every worker: a pass's first hook
            self._new_plan = False
            self._announced = False
            self._traffic.begin_round()
            for bucket in buckets:
                bucket.ready = [False] * len(bucket.params)
                bucket.tensor = bucket.buffer  # a solo bucket lets go of the last round's gradient
            self._next_launch = 0
            self._sparse_deltas = {}

    def _end_round(self, index: int, state: Round) -> None:
        """End of the backward pass: start every expected bucket, wait, then the buckets that
        were not expected but some worker wrote to (the flags say which), and install
        base + sum (all workers; blocks until the all-reduces finish).

        Raises:
            PeerUnavailableError: (from ``wait``) a worker died or stopped answering.
        """
        with self._lock:
            buckets = self._ensure_built()
            self._bases = state.bases
            for bucket in buckets:
                for i, ready in enumerate(bucket.ready):
                    if not ready:
                        self._not_reached(bucket, i)
            self._launch_ready(buckets, at_end=True)
            self._flush_running(self._wait_at_end)
            _read_flags(buckets)
            self._launch_late(buckets)
            newly_sparse: set[int] = set()
            dead: set[int] = set()
            for bucket in buckets:
                newly_sparse |= self._install(bucket, dead)
            self._expect(buckets)
            if newly_sparse:  # agreed by every worker (the flags were summed): rebuild without them
                for k, ref in enumerate(self._params):
                    self._is_sparse[k] = self._is_sparse[k] or id(ref()) in newly_sparse
                self._buckets = None
            if dead:  # dead on every worker (agreed the same way): forget their slots
                self._forget(dead)
            self._sum_sparse_deltas()
            self._bases = {}
            self._sparse_deltas = {}

    def _not_reached(self, bucket: Bucket, i: int) -> None:
        """A parameter this pass did not accumulate into: no delta; its ``.grad`` stays. In an
        expected bucket its slot carries zeros; in another, only its flag says "none" (the
        zeros are written if the bucket goes late after all, `_launch_late`)."""
        p = bucket.params[i]
        if id(p) in self._bases:
            p.grad = self._bases.pop(id(p))
        if not bucket.expected:
            bucket.had[i] = 0.0
            return
        g = p.grad
        if g is not None and bucket.owns(g):
            p.grad = g.clone()  # the buffer is about to carry this round's deltas
        bucket.put(i, None)

    def _launch_late(self, buckets: list[Bucket]) -> None:
        """Starts and waits for the buckets this round did not expect but some worker wrote
        to (after the flags' sum: every worker starts the same ones, in order)."""
        late = [k for k, bucket in enumerate(buckets) if not bucket.expected and any(bucket.summed_had)]
        if not late:
            return
        if self._announce is not None:
            self._announce([])  # these were not in the pass's announcement, nor in the next's
        for k in late:
            bucket = buckets[k]
            bucket.expected = True  # its unreached slots now carry zeros
            for i, ready in enumerate(bucket.ready):
                if not ready:
                    self._not_reached(bucket, i)
            self._launch(buckets, k)
        self._flush_running(self._wait_at_end)

    def _expect(self, buckets: list[Bucket]) -> None:
        """Decides which buckets the next round launches in order (every worker alike: from
        the summed flags): those some worker is predicted to write to, and the flags' bucket.
        The prediction is whether some worker wrote to it in this round, unless the last four
        rounds alternate: passes that alternate between two sets (a GAN's discriminator step,
        then a generator step through both) then get the answer of two rounds back, so
        neither set is sent as zeros nor late. A model the loop stopped training costs one
        round of zeros; a bucket written again after a round without costs one late exchange.
        A change of the set is a new pass for the announcement, as a rebuild is."""
        last = len(buckets) - 1
        for k, bucket in enumerate(buckets):
            bucket.history = (bucket.history << 1 | any(bucket.summed_had)) & 0b1111
            # (a younger bucket's history has zeros before it was built: never a false pattern)
            two_back = bucket.history in _ALTERNATING
            expected = k == last or bool(bucket.history & (0b10 if two_back else 0b1))
            if expected != bucket.expected:
                bucket.expected = expected
                self._new_plan = True

    def _install(self, bucket: Bucket, dead: set[int]) -> set[int]:
        """Installs a summed bucket's base + sum; returns the ids of its parameters some
        worker found sparse, and adds to ``dead`` the slots that died on every worker."""
        had = bucket.summed_had
        dead.update(k for k, n in zip(bucket.slots, bucket.summed_dead, strict=True) if n >= self._workers)
        sparse = set()
        for i, p in enumerate(bucket.params):
            if had[i] >= SPARSE:
                sparse.add(id(p))
            elif had[i] > 0 and p.device.type != "meta":  # not the placeholder of a dead parameter
                base = self._bases.get(id(p)) if bucket.had[i] else p.grad
                if base is None and bucket.solo and p.grad is bucket.tensor:
                    continue  # reduced where autograd put it: .grad holds the sum already
                p.grad = bucket.view(i) if base is None else base.add_(bucket.view(i))
        return sparse

    def _sum_sparse_deltas(self) -> None:
        """Sums every sparse parameter's delta across workers, in registration order (all
        workers; blocks); installs base + sum where some worker had a delta."""
        for k, ref in enumerate(self._params):
            if not self._is_sparse[k]:
                continue
            p = ref()
            shape, dtype, device = self._layout[k]
            delta = self._sparse_deltas.get(id(p)) if p is not None else None
            total = self._sum_sparse(delta if delta is not None else empty_sparse(shape, dtype, device))
            if p is None or total._nnz() == 0:
                continue
            base = self._bases.get(id(p)) if delta is not None else p.grad
            p.grad = plus(base, total)

    def _forget(self, slots: set[int]) -> None:
        """Drops the slots of parameters dead on every worker (all workers, same round)."""
        keep = [k for k in range(len(self._params)) if k not in slots]
        self._params = [self._params[k] for k in keep]
        self._layout = [self._layout[k] for k in keep]
        self._is_sparse = [self._is_sparse[k] for k in keep]
        self._ids = {i: ref for i, ref in self._ids.items() if ref() is not None}
        self._buckets = None

    def abort_round(self) -> None:
        """Forgets a round whose backward pass raised (its end-of-backward callback never
        ran): the moved-aside gradients go back."""
        with self._lock:
            self._rounds.abort()

    def _launch_ready(self, buckets: list[Bucket], at_end: bool = False) -> None:
        """Starts the expected buckets that are complete, in order; the flags' bucket (the
        last) only once every flag is known: at the end of the pass when some bucket is not
        expected (a delta may still reach it), else when it is complete too."""
        last = len(buckets) - 1
        while self._next_launch < len(buckets):
            k = self._next_launch
            bucket = buckets[k]
            if not bucket.expected:  # left for the round's end, if a worker wrote to it
                self._next_launch += 1
                continue
            if not bucket.complete():
                return
            if k == last and not at_end and not all(b.expected for b in buckets):
                return
            self._launch(buckets, k)
            self._next_launch += 1

    def _launch(self, buckets: list[Bucket], k: int) -> None:
        """Starts bucket ``k``'s all-reduce (the first of a pass announces the pass; the last
        bucket writes every bucket's flags first)."""
        bucket = buckets[k]
        for p in bucket.params:
            # A .grad that is a view of this buffer (installed at the last step) must not be
            # written by autograd while the buffer is being reduced: give it its own memory.
            g = p.grad
            if g is not None and bucket.owns(g):
                p.grad = g.clone()
        if not self._announced and self._announce is not None:
            self._announced = True
            plan = [(b.size, b.dtype, not _is_flags(b)) for b in buckets if b.expected]
            self._announce(self._traffic.plan(plan))
        if k == len(buckets) - 1:  # the last: every bucket's flags are known
            _write_flags(buckets)
        assert bucket.tensor is not None
        views, compressible = _compressible(bucket) if self._traffic.compressor else ([], False)
        bucket.work = self._traffic.start(k, bucket.tensor.view(-1), views, compressible)

    def _flush_running(self, wait: Wait | None = None) -> None:
        """Waits for the all-reduces still running (the round's sums at its end; otherwise
        superseded ones)."""
        wait = wait or self._wait
        for bucket in self._buckets or []:
            if bucket.work is not None:
                work, bucket.work = bucket.work, None
                work.finish(wait)

    def release(self) -> None:
        """Removes the hooks without waiting for anything (their group failed and is dropped:
        an elastic job re-forming makes new buckets on its new group)."""
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._rounds.abort()

    def close(self) -> None:
        """Removes the hooks and waits for running all-reduces (all workers)."""
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._flush_running()


def _is_flags(bucket: Bucket) -> bool:
    """Whether ``bucket`` carries the flags (never compressed)."""
    return not bucket.params or (bucket.flags is not None and bool(bucket.flags.numel()))


def _compressible(bucket: Bucket) -> tuple[list[torch.Tensor], bool]:
    """Each parameter's view of ``bucket`` and whether it may be compressed (not the flags)."""
    if _is_flags(bucket):
        return [], False
    return [bucket.view(i) for i in range(len(bucket.params))], True


def _write_flags(buckets: list[Bucket]) -> None:
    """Puts this worker's flags of every bucket after the last bucket's gradients."""
    flags = buckets[-1].flags
    assert flags is not None
    had = [f for bucket in buckets for f in bucket.had]
    dead = [f for bucket in buckets for f in bucket.dead_here]
    flags.copy_(torch.tensor(had + dead, dtype=flags.dtype))


def _read_flags(buckets: list[Bucket]) -> None:
    """Hands each bucket its summed flags (after every bucket's all-reduce finished)."""
    flags = buckets[-1].flags if buckets else None
    if flags is None:
        return
    summed = flags.tolist()
    half = len(summed) // 2
    start = 0
    for bucket in buckets:
        end = start + len(bucket.params)
        bucket.summed_had, bucket.summed_dead = summed[start:end], summed[half + start : half + end]
        start = end
