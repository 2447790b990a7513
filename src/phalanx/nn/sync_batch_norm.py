"""SyncBatchNorm: batch statistics of the whole global batch, across replicas and workers."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from phalanx import context

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over the global batch (tf.keras.layers.BatchNormalization(synchronized=True)).

    In training mode inside ``strategy.run`` every replica contributes its per-channel count,
    sum and sum of squares to one differentiable all-reduce (across local replicas and
    workers), so all replicas normalise with the statistics of the whole global batch and
    keep identical running statistics. In eval mode, outside ``run`` or with one replica, it
    is exactly ``torch.nn.BatchNorm*d`` and communicates nothing. Accepts (N, C, ...) inputs.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects inputs of shape (N, C, ...). Received: {tuple(input.shape)}."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        ctx = context.get_replica_context()
        if not self.training or ctx is None or ctx.num_replicas_in_sync == 1:
            return super().forward(input)
        reduce_dims = [0, *range(2, input.dim())]
        count = torch.tensor(input.numel() // max(input.shape[1], 1), dtype=input.dtype, device=input.device)
        total, total_sq, n = ctx.all_reduce(
            "sum", [input.sum(reduce_dims), (input * input).sum(reduce_dims), count]
        )
        mean = total / n
        var = (total_sq / n - mean * mean).clamp_min(0.0)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), n.detach())
        shape = [1, -1] + [1] * (input.dim() - 2)
        out = (input - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        assert self.num_batches_tracked is not None
        assert self.running_mean is not None
        assert self.running_var is not None
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            unbiased = var * (n / (n - 1).clamp_min(1.0))
            self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module) -> nn.Module:
        """Replaces every BatchNorm*d in ``module`` by a SyncBatchNorm with the same state.

        Call it inside the strategy scope so the new parameters are distributed.
        """
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            converted = cls(
                module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
            )
            with torch.no_grad():
                if module.affine:
                    converted.weight.copy_(module.weight)
                    converted.bias.copy_(module.bias)
                if module.track_running_stats:
                    assert converted.running_mean is not None
                    assert converted.running_var is not None
                    converted.running_mean.copy_(module.running_mean)  # type: ignore[arg-type]
                    converted.running_var.copy_(module.running_var)  # type: ignore[arg-type]
                    converted.num_batches_tracked.copy_(module.num_batches_tracked)  # type: ignore[union-attr,arg-type]
            converted.train(module.training)
            return converted
        for name, child in module.named_children():
            module.add_module(name, cls.convert_sync_batchnorm(child))
        return module
