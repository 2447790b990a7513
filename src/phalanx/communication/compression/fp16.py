"""``compression="fp16"`` / ``"bf16"``: the bucket goes over the wire in half precision.

Horovod's ``Compression.fp16`` and DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``: each
worker casts its bucket down, the all-reduce sums the half-precision values, and the sum is cast
back into the bucket. The sum happens in the low precision on every transport: gloo's
reduction, the shared-memory segment's and the TLS ring's additions all add float16 (bfloat16)
values and round the result to it, once per worker added. So the sum carries the rounding of the
narrow type (float16: 11 significant bits; bfloat16: 8), not only the cast of each worker's part.

float16 holds numbers up to 65504: as DDP's hook does, each worker casts its bucket and divides
it by the number of workers in float16 (two passes, the second over half the bytes: dividing
in float32 first was a third pass over the widest copy), and the sum is multiplied back in the
bucket's own dtype, so a sum of ``n`` large gradients does not overflow where one does not.
bfloat16 has float32's range and is not scaled. Buckets of a dtype not wider than the wire's
(float16, bfloat16) go as they are.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from phalanx.communication.compression.base import WHAT, Launch, Started, Wait

__all__ = ["HalfPrecision"]

_WIDE = (torch.float32, torch.float64)


class HalfPrecision:
    """Casts each bucket to ``wire`` for its all-reduce (stateless).

    Args:
        wire: ``torch.float16`` or ``torch.bfloat16``.
        workers: How many workers sum (float16 divides by it before the cast).
    """

    predictable = True  # one all-reduce per bucket, in ``wire``: a pass can be announced

    def __init__(self, wire: torch.dtype, workers: int) -> None:
        self.wire = wire
        self._scale = float(workers) if wire == torch.float16 else 1.0

    def applies(self, dtype: torch.dtype) -> bool:
        return dtype in _WIDE

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire

    def begin_round(self) -> None:
        pass

    def start(
        self, key: Hashable, flat: torch.Tensor, views: Sequence[torch.Tensor], launch: Launch
    ) -> Started:
        narrow = flat.to(self.wire)
        if self._scale != 1.0:
            narrow.div_(self._scale)
        return _Cast(flat, narrow, self._scale, launch(narrow))

    def reset(self) -> None:
        pass


class _Cast:
    def __init__(self, flat: torch.Tensor, narrow: torch.Tensor, scale: float, work: object) -> None:
        self._flat, self._narrow, self._scale, self._work = flat, narrow, scale, work

    def finish(self, wait: Wait) -> None:
        wait(self._work, WHAT)
        self._flat.copy_(self._narrow)
        if self._scale != 1.0:
            self._flat.mul_(self._scale)
