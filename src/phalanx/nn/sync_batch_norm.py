"""SyncBatchNorm: batch statistics of the whole global batch, across replicas and workers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from phalanx import context
from phalanx.variables import DistributedVariable

__all__ = ["SyncBatchNorm", "converted_in_scope"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over the global batch (``BatchNormalization(synchronized=True)`` in Keras).

    Takes the arguments of ``torch.nn.BatchNorm1d/2d/3d`` and inputs of shape ``(N, C)``,
    ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``.

    In training mode inside ``strategy.run`` every replica (all replicas) contributes its
    per-channel example count, sum and sum of squares to one differentiable SUM all-reduce,
    across the local replicas and the workers. Every replica then normalises with the mean
    and biased variance of the whole global batch, and updates its running statistics with
    the unbiased variance, as ``torch.nn.BatchNorm`` does, so the running statistics are
    the same on every replica. Gradients are those of BatchNorm on the global batch because
    the all-reduce is differentiable. A replica with an empty batch still joins the
    all-reduce, with a count of 0.

    Sums are formed from each replica's own mean and variance and combined in float64, so a
    large mean does not cancel the variance away (the textbook ``E[x^2] - E[x]^2`` in float32
    loses the variance of data whose mean is much larger than its spread).

    In eval mode the running statistics are used and nothing is communicated. With one
    replica in sync (outside any strategy, `OneDeviceStrategy`) it is exactly
    ``torch.nn.BatchNorm``. A training-mode call outside ``run`` on a layer built in a
    strategy's scope normalises with the statistics of the batch it is given and writes the
    running statistics of every replica.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects inputs of shape (N, C, ...). Received: {tuple(input.shape)}."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalises ``input`` (see the class docstring for when replicas communicate).

        Raises:
            ValueError: ``input`` has fewer than 2 dimensions or not ``num_features`` channels.
        """
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) expects {self.num_features} channels in "
                f"dimension 1. Received an input of shape {tuple(input.shape)}."
            )
        ctx = context.current_replica_context()
        sync = ctx is not None and ctx.num_replicas_in_sync > 1
        if not sync and not isinstance(self.running_mean, DistributedVariable):
            return super().forward(input)
        # Distributed buffers outside `run` are read as their aggregate, a temporary that
        # F.batch_norm would update in vain: update them here, through the variables.
        count, total, total_sq = _local_moments(input)
        if sync:  # a replica of a multi-replica strategy: sum over the global batch
            assert ctx is not None
            packed = torch.cat([count.reshape(1), total, total_sq])  # (1 + 2C,) float64
            count, total, total_sq = ctx.all_reduce("sum", packed).split(
                [1, self.num_features, self.num_features]
            )
        mean = total / count.clamp_min(1.0)
        var = (total_sq / count.clamp_min(1.0) - mean * mean).clamp_min(0.0)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count.detach())
        return self._normalize(input, mean, var)

    def _normalize(self, input: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        x = input.float() if input.dtype in _LOW_PRECISION else input
        shape = [1, -1] + [1] * (input.dim() - 2)
        invstd = torch.rsqrt(var.to(x.dtype) + self.eps)
        out = (x - mean.to(x.dtype).reshape(shape)) * invstd.reshape(shape)
        if self.weight is not None:
            out = out * self.weight.reshape(shape)
        if self.bias is not None:
            out = out + self.bias.reshape(shape)
        return out.to(input.dtype)

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        running_mean, running_var, tracked = self.running_mean, self.running_var, self.num_batches_tracked
        assert running_mean is not None
        assert running_var is not None
        assert tracked is not None
        with torch.no_grad():
            tracked.add_(1)
            momentum = 1.0 / float(tracked) if self.momentum is None else self.momentum
            unbiased = var * (count / (count - 1.0).clamp_min(1.0))
            running_mean.mul_(1.0 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1.0 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module) -> nn.Module:
        """Replaces every ``torch.nn.BatchNorm*d`` (any ``_BatchNorm``) in ``module`` by a SyncBatchNorm.

        The new layers take over the old ones' parameters and buffers (the same objects, as
        ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does), their training flag and
        ``qconfig``. Call it inside the strategy scope, so that parameters of a model built
        outside the scope become distributed variables.

        Returns:
            ``module`` with its batch-norm layers replaced, or the new layer when ``module``
            itself is one.

        Raises:
            ValueError: A lazy batch-norm layer has not been initialised by a forward pass yet.
        """
        output = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            output = _from_batchnorm(cls, module)
        for name, child in module.named_children():
            output.add_module(name, cls.convert_sync_batchnorm(child))
        return output


def _from_batchnorm(cls: type[SyncBatchNorm], module: _BatchNorm) -> SyncBatchNorm:
    """A ``cls`` (SyncBatchNorm or a subclass) holding ``module``'s tensors (see
    `SyncBatchNorm.convert_sync_batchnorm`)."""
    if any(t is not None and is_lazy(t) for t in (module.weight, module.running_mean)):
        raise ValueError(
            f"Cannot convert the uninitialised lazy layer {module!r}. HINT: run one forward "
            "pass (to infer num_features) before convert_sync_batchnorm."
        )
    extra: dict[str, Any] = {"bias": False} if module.affine and module.bias is None else {}
    output = cls(
        module.num_features,
        module.eps,
        module.momentum,
        module.affine,
        module.track_running_stats,
        **extra,
    )
    if module.affine:
        output.weight = module.weight
        if module.bias is not None:
            output.bias = module.bias
    output.running_mean = module.running_mean
    output.running_var = module.running_var
    output.num_batches_tracked = module.num_batches_tracked
    output.train(module.training)
    if hasattr(module, "qconfig"):
        output.qconfig = module.qconfig
    return output


def converted_in_scope(module: nn.Module) -> SyncBatchNorm | None:
    """The SyncBatchNorm that replaces a batch-norm layer registered in the scope of a strategy
    made with ``sync_batch_norm=True``; None for other modules (they stay as they are).

    Called by the submodule-registration hook (`phalanx._hooks`), inside the scope: the layer's
    own tensors, already the strategy's variables, move to the new layer. Layers nested in
    ``module`` were converted when they were registered in it.

    Raises:
        ValueError: An uninitialised lazy batch-norm layer (its size is not known yet).
    """
    if not isinstance(module, _BatchNorm) or isinstance(module, SyncBatchNorm):
        return None
    if any(t is not None and is_lazy(t) for t in (module.weight, module.running_mean)):
        raise ValueError(
            "A strategy made with sync_batch_norm=True converts batch-norm layers when they are "
            f"registered, and cannot convert an uninitialised lazy one. Received: {module!r}. "
            "HINT: give num_features (torch.nn.BatchNorm2d), or make the strategy without "
            "sync_batch_norm and call phalanx.nn.SyncBatchNorm.convert_sync_batchnorm(model) in "
            "the scope after one forward pass."
        )
    return _from_batchnorm(SyncBatchNorm, module)


def _local_moments(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This replica's per-channel (count, sum, sum of squares), in float64, differentiable.

    The sums come from the local mean and biased variance (``torch.var_mean``, accurate in
    the input's precision) rather than from squaring raw values.
    """
    dims = [0, *range(2, input.dim())]
    channels = input.shape[1]
    n = input.numel() // channels if channels else 0
    count = torch.tensor(float(n), dtype=torch.float64, device=input.device)
    if n == 0:  # an empty replica batch: zeros, still connected to the graph
        zeros = input.sum(dims).to(torch.float64)
        return count, zeros, zeros
    x = input.float() if input.dtype in _LOW_PRECISION else input
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    mean64, var64 = mean.to(torch.float64), var.to(torch.float64)
    return count, mean64 * n, (var64 + mean64 * mean64) * n
