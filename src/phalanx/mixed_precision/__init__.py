"""Mixed precision: TF's dtype policies and dynamic loss scaling, for every strategy.

See docs/mixed_precision.md.

* `Policy` (``"float32"``, ``"mixed_float16"``, ``"mixed_bfloat16"``), `set_global_policy`,
  `global_policy`: variables stay float32, computation runs in the policy's compute dtype
  under ``torch.autocast`` (`Policy.autocast`).
* `GradScaler`: ``torch.amp.GradScaler`` that keeps one scale per local replica, so it works
  inside ``strategy.run`` with several replicas in one process; `LossScaleOptimizer`: TF's
  wrapper over an optimizer. Under every synchronous strategy ``.grad`` holds the sum over
  all replicas once ``backward()`` returns, so every replica of every worker finds the same
  overflow: if any replica's gradients overflowed, every replica skips the step and lowers
  its scale.
"""

from __future__ import annotations

from phalanx.mixed_precision.loss_scale import GradScaler, LossScaleOptimizer
from phalanx.mixed_precision.policy import Policy, global_policy, set_global_policy

__all__ = ["GradScaler", "LossScaleOptimizer", "Policy", "global_policy", "set_global_policy"]
