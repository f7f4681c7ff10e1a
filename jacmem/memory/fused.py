"""BatchNorm + LeakyReLU in one layer that keeps only its output (InPlace-ABN,
Rota Bulò et al., 2018).

``z = leaky_relu(y)``, ``y = x̂ · w + b``, ``x̂ = (x - μ) / σ``. Stock PyTorch keeps x
for the batch norm and y for the activation: two tensors of the input's size. Leaky
ReLU with a positive slope is invertible, and so is the affine map where ``w ≠ 0``;
the backward pass rebuilds ``y = z`` (z > 0) or ``z / slope`` (z ≤ 0), then
``x̂ = (y - b) / w``, and needs nothing else of the size of x.

With ``dy = dz · (1 if z > 0 else slope)``, sums over the batch and spatial axes
(``M`` elements per channel):

* ``∂b = Σ dy``, ``∂w = Σ dy · x̂``
* training (batch statistics): ``∂x = w/σ · (dy - ∂b/M - x̂ · ∂w/M)``
* eval (running statistics): ``∂x = w/σ · dy``

Support: training and eval mode, ``affine`` True or False, ``track_running_stats``
True or False (then batch statistics in both modes, as stock BatchNorm does),
inputs ``[N, C, *S]`` of any rank. Not supported: ``negative_slope <= 0`` (not
invertible: use BatchNorm + ReLU) and a weight with a zero entry while gradients are
recorded (x̂ cannot be rebuilt; the forward raises). Recovering x̂ divides by w: with
weights of tiny magnitude the gradients lose accuracy in proportion.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from jacmem.memory.functions import all_but_channels, channel_view


class BatchNormActFunction(torch.autograd.Function):
    """x [N, C, *S] -> z [N, C, *S]; keeps z, and [C]-sized statistics and parameters."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps, slope):
        y, mean, invstd = torch.ops.aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
        if not training:
            invstd = torch.rsqrt(running_var + eps)
        z = F.leaky_relu_(y, slope)
        ctx.training, ctx.slope = training, slope
        ctx.save_for_backward(z, weight, bias, invstd)
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx, dz):
        z, weight, bias, invstd = ctx.saved_tensors
        nd, dims = z.dim(), all_but_channels(z.dim())
        positive = z > 0
        dy = torch.where(positive, dz, dz * ctx.slope)
        y = torch.where(positive, z, z / ctx.slope)
        xhat = y if weight is None else (y - channel_view(bias, nd)) / channel_view(weight, nd)
        db = dy.sum(dims)
        dw = (dy * xhat).sum(dims)
        scale = channel_view(invstd if weight is None else weight * invstd, nd)
        gx = None
        if ctx.needs_input_grad[0]:
            if ctx.training:
                m = z.numel() // z.shape[1]
                gx = (dy - channel_view(db / m, nd) - xhat * channel_view(dw / m, nd)) * scale
            else:
                gx = dy * scale
        gw = dw if ctx.needs_input_grad[1] else None
        gb = db if ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None, None, None, None


class BatchNormAct(nn.modules.batchnorm._BatchNorm):
    """``LeakyReLU(negative_slope)(BatchNormNd(num_features)(x))`` for ``x [N, C, *S]``, in one
    layer that keeps only its output for the backward pass.

    Parameters, buffers and ``state_dict`` keys are those of ``nn.BatchNorm2d``, so
    ``BatchNormAct(c).load_state_dict(bn.state_dict())`` takes over a trained layer;
    :meth:`from_batchnorm` does that.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        negative_slope: float = 0.01,
        device=None,
        dtype=None,
    ):
        if not negative_slope > 0:
            raise ValueError(
                f"BatchNormAct needs negative_slope > 0 to invert the activation, got {negative_slope}; "
                "for ReLU keep nn.BatchNorm + nn.ReLU (jacmem.memory.lean packs ReLU's mask to 1 bit)"
            )
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.negative_slope = negative_slope

    @classmethod
    def from_batchnorm(cls, bn: nn.modules.batchnorm._BatchNorm, negative_slope: float = 0.01) -> BatchNormAct:
        """A BatchNormAct with ``bn``'s settings, parameters, buffers and mode."""
        like = next((t for t in bn.state_dict().values() if t.is_floating_point()), torch.empty(0))
        fused = cls(
            bn.num_features,
            bn.eps,
            bn.momentum,
            bn.affine,
            bn.track_running_stats,
            negative_slope,
            device=like.device,
            dtype=like.dtype,
        )
        fused.load_state_dict(bn.state_dict())
        return fused.train(bn.training)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"BatchNormAct expects input [N, C, *S], got shape {tuple(input.shape)}")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, negative_slope={self.negative_slope}"

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        training = self.training or self.running_mean is None
        track = not self.training or self.track_running_stats
        if self.weight is not None and torch.is_grad_enabled() and bool((self.weight == 0).any()):
            raise ValueError(
                "BatchNormAct cannot invert a zero weight to rebuild its input in backward; "
                "set those weights nonzero, or use nn.BatchNorm + nn.LeakyReLU for this layer"
            )
        return BatchNormActFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            training,
            momentum,
            self.eps,
            self.negative_slope,
        )
