"""Normalisation layers: BatchNorm1d/2d/3d (eval mode), LayerNorm, GroupNorm,
InstanceNorm1d/2d/3d and RMSNorm.

Each computes ``y = x̂ ⊙ weight + bias``, where ``x̂`` is the input normalised with
statistics that do not depend on ``weight`` and ``bias``. So, for sample ``n``,

    grad_weight[n] = Σ_a g[n] ⊙ x̂[n],        grad_bias[n] = Σ_a g[n],

summed over the axes ``a`` along which the parameters are broadcast:

* channel layout, ``x [N, C, *S]``, parameters ``[C]``: BatchNorm, GroupNorm,
  InstanceNorm; ``a`` = the spatial axes ``S``;
* trailing layout, ``x [N, *, *normalized_shape]``, parameters ``normalized_shape``:
  LayerNorm, RMSNorm; ``a`` = the middle axes ``*``.

These are the per-sample gradients exactly when ``x̂[n]`` depends on sample ``n`` alone:
LayerNorm, GroupNorm, InstanceNorm and RMSNorm normalise within a sample (InstanceNorm
with ``track_running_stats`` in eval mode uses its running statistics, and so does
this); BatchNorm in eval mode uses its running statistics. All read at forward time,
with the mode the forward ran in.

BatchNorm that used batch statistics (training mode, or ``track_running_stats=False``,
which uses them in eval mode too) **raises**, for every extension. Every sample's output
then depends on the whole batch, so the per-sample gradients of the loss are not
defined: the output gradient ``g`` that reaches the layer, and every layer below it,
mixes samples. BackPACK 1.7.1 warns for ``BatchGrad`` (and returns ``g[n] ⊙ x̂[n]`` with
the batch statistics, which sums to ``.grad`` but is no per-sample gradient) and raises
``NotImplementedError`` for ``BatchL2Grad``, ``SumGradSquared`` and ``Variance``. We
raise for all four: numbers that look like per-sample gradients but are not would
silently corrupt what they feed (clipping in DP-SGD, variance estimates), and one
behaviour for every extension is easier to reason about than BackPACK's split.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from jacmem.derivatives.registry import Cost, Kronecker, layer, passthrough, register


class BatchStatisticsError(RuntimeError):
    """A BatchNorm used batch statistics: its samples interact."""


def _running(module: nn.Module) -> tuple[Tensor, Tensor]:
    """Copies of the running mean and variance ``[C]``, as they were at forward time."""
    return module.running_mean.detach().clone(), module.running_var.detach().clone()


def batch_norm_hyperparams(module: nn.modules.batchnorm._BatchNorm) -> dict:
    """BatchNorm: running statistics in eval mode; batch statistics otherwise."""
    batch_statistics = module.training or module.running_mean is None
    return dict(
        eps=module.eps,
        center=True,
        trailing=0,
        groups=module.num_features,
        running=None if batch_statistics else _running(module),
        batch_statistics=batch_statistics,
    )


def instance_norm_hyperparams(module: nn.modules.instancenorm._InstanceNorm) -> dict:
    """InstanceNorm: each (sample, channel) alone; running statistics in eval mode if tracked."""
    use_running = not module.training and module.track_running_stats
    return dict(
        eps=module.eps,
        center=True,
        trailing=0,
        groups=module.num_features,
        running=_running(module) if use_running else None,
        batch_statistics=False,
    )


def group_norm_hyperparams(module: nn.GroupNorm) -> dict:
    """GroupNorm: each (sample, group of channels) alone."""
    return dict(eps=module.eps, center=True, trailing=0, groups=module.num_groups, running=None, batch_statistics=False)


def layer_norm_hyperparams(module: nn.LayerNorm) -> dict:
    """LayerNorm: each sample's trailing ``normalized_shape`` alone."""
    return dict(
        eps=module.eps,
        center=True,
        trailing=len(module.normalized_shape),
        groups=None,
        running=None,
        batch_statistics=False,
    )


def rms_norm_hyperparams(module: nn.RMSNorm) -> dict:
    """RMSNorm: as LayerNorm, not centred; ``eps=None`` means the input dtype's eps."""
    return dict(layer_norm_hyperparams(module), center=False)


def check_sample_wise(batch_statistics: bool) -> None:
    """Raise where the forward normalised with the batch's statistics."""
    if batch_statistics:
        raise BatchStatisticsError(
            "this BatchNorm normalised with the statistics of the batch (training mode, or "
            "track_running_stats=False), so each sample's output depends on every other sample "
            "and per-sample gradients are not defined (for this layer or any layer below it). "
            "Run the forward in eval mode (model.eval()) with running statistics, or use a "
            "normalisation within each sample (GroupNorm, LayerNorm)."
        )


def normalized(x: Tensor, *, eps, center, trailing, groups, running, batch_statistics) -> Tensor:
    """x̂, the input as normalised before the affine map: ``[N, C, *S]`` (channel
    layout, ``trailing == 0``) or ``[N, *, *normalized_shape]`` -> same shape."""
    check_sample_wise(batch_statistics)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    if running is not None:
        mean, var = (t.view(-1, *[1] * (x.dim() - 2)) for t in running)
        return (x - mean) * torch.rsqrt(var + eps)
    if trailing and center:  # LayerNorm's own: one fused kernel, not five passes over x
        return F.layer_norm(x, x.shape[x.dim() - trailing :], eps=eps)
    if trailing:
        y, dims = x, tuple(range(-trailing, 0))
    else:
        y = x.unflatten(1, (groups, -1))
        dims = tuple(range(2, y.dim()))
    if center:
        y = y - y.mean(dims, keepdim=True)
    y = y * torch.rsqrt(y.square().mean(dims, keepdim=True) + eps)
    return y.reshape(x.shape)


def per_sample(t: Tensor, trailing: int) -> Tensor:
    """Sum over the axes the parameters are broadcast along: ``[N, C, *S] -> [N, C]``
    (``trailing == 0``), ``[N, *, *normalized_shape] -> [N, *normalized_shape]``."""
    if trailing:
        return t.reshape(t.shape[0], -1, *t.shape[t.dim() - trailing :]).sum(1)
    return t.reshape(*t.shape[:2], -1).sum(2)


def _weight_cost(xs, gs, **_) -> Cost:
    size = prod(xs)
    return Cost(flops=8 * size, workspace=2 * size)


def weight_batch_grad(x: Tensor, g: Tensor, **hp) -> Tensor:
    """Per-sample weight gradients ``Σ_a g ⊙ x̂``: ``x``, ``g`` ``[N, C, *S]`` or
    ``[N, *, *normalized_shape]`` -> ``[N, C]`` or ``[N, *normalized_shape]``"""
    return per_sample(g * normalized(x, **hp), hp["trailing"])


def bias_batch_grad(x, g: Tensor, *, trailing, batch_statistics, **_) -> Tensor:
    """Per-sample bias gradients ``Σ_a g``: -> ``[N, C]`` or ``[N, *normalized_shape]``"""
    check_sample_wise(batch_statistics)
    return per_sample(g, trailing)


def squared_vjps(x, S: Tensor, params, batch: bool, budget: float, **hp) -> dict[str, Tensor] | None:
    """The GGN diagonal's ``Σ_v (J_θᵀ S[v])²`` of a norm over the trailing axes
    (LayerNorm, RMSNorm), with ``x̂`` formed once for the weight: ``x [N, *, *ns]``,
    ``S [V, N, *, *ns]`` -> ``[(N,) *ns]`` per parameter; ``None`` for the channel
    layout (the per-sample gradients then)."""
    trailing = hp["trailing"]
    if not trailing or not isinstance(x, Tensor):
        return None
    out = {}
    for name in params:
        g = S * normalized(x, **hp) if name == "weight" else S  # [V, N, *, *ns]
        g = per_sample(g.flatten(0, 1), trailing).unflatten(0, S.shape[:2]).square().sum(0)  # [N, *ns]
        out[name] = g if batch else g.sum(0)
    return out


_HYPERPARAMS = {
    nn.BatchNorm1d: batch_norm_hyperparams,
    nn.BatchNorm2d: batch_norm_hyperparams,
    nn.BatchNorm3d: batch_norm_hyperparams,
    nn.InstanceNorm1d: instance_norm_hyperparams,
    nn.InstanceNorm2d: instance_norm_hyperparams,
    nn.InstanceNorm3d: instance_norm_hyperparams,
    nn.GroupNorm: group_norm_hyperparams,
    nn.LayerNorm: layer_norm_hyperparams,
}
#: nn.RMSNorm came with torch 2.4
_RMS_NORM = getattr(nn, "RMSNorm", None)

for _module, _hyperparams in _HYPERPARAMS.items():
    # all but LayerNorm normalise over axis 1 ([N, C, *]): their batch is axis 0, whatever the block's batch_first
    layer(_module, hyperparams=_hyperparams, input_free=("bias",), own_layout=_module is not nn.LayerNorm)
    register(_module, "weight", "batch_grad", "sum", cost=_weight_cost)(weight_batch_grad)
    register(_module, "bias", "batch_grad", "sum")(bias_batch_grad)
for _module in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
    layer(
        _module,
        kronecker=Kronecker(
            why_not="its parameters are per-channel vectors scaled by the normalised input, with no standard "
            "Kronecker factorisation (BackPACK has none either)"
        ),
    )


def _recognise(center: bool) -> Callable[[nn.Module, Any, Any], dict | None]:
    """LayerNorm's (RMSNorm's, without ``center``) ``recognise``: a module whose only
    parameters are ``weight`` (and, centred, ``bias``) over the input's trailing axes,
    with ``eps`` or ``variance_epsilon`` (HF's name), whose output on this call equals
    ``F.layer_norm`` (``F.rms_norm``) of its input to rounding."""

    def recognise(module: nn.Module, x: Any, output: Any) -> dict | None:
        params = dict(module.named_parameters(recurse=False))
        weight, bias = params.pop("weight", None), params.pop("bias", None)
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        plain = isinstance(x, Tensor) and isinstance(output, Tensor) and x.shape == output.shape
        if params or weight is None or (bias is not None and not center) or not isinstance(eps, float) or not plain:
            return None
        shape = tuple(weight.shape)
        if x.shape[x.dim() - len(shape) :] != shape or (bias is not None and bias.shape != weight.shape):
            return None
        with torch.no_grad():
            ref = F.layer_norm(x, shape, weight, bias, eps) if center else F.rms_norm(x, shape, weight, eps)
            tol = 8 * torch.finfo(output.dtype).eps
            scale = max(float(output.abs().max()), 1.0)
            if not torch.allclose(ref.to(output.dtype), output, rtol=tol, atol=tol * scale):
                return None
        return dict(eps=eps, center=center, trailing=len(shape), groups=None, running=None, batch_statistics=False)

    return recognise


# LayerNorm and RMSNorm scale each entry by its own parameter: KFAC/KFLR give their GGN diagonal
_DIAGONAL = Kronecker(diagonal=True)
layer(nn.LayerNorm, recognise=_recognise(center=True), kronecker=_DIAGONAL, squared_vjps=squared_vjps)
if _RMS_NORM is not None:  # a weight, and no bias
    layer(
        _RMS_NORM,
        hyperparams=rms_norm_hyperparams,
        recognise=_recognise(center=False),
        kronecker=_DIAGONAL,
        squared_vjps=squared_vjps,
    )
    register(_RMS_NORM, "weight", "batch_grad", "sum", cost=_weight_cost)(weight_batch_grad)


# -- Input Jacobian, for second-order extensions ---------------------------------------


def _eval_only(module: nn.Module) -> dict[str, Any]:
    if module.training:
        raise NotImplementedError(
            f"second-order extensions need {type(module).__name__} in eval mode: in training mode it mixes "
            "the samples of the batch (batch statistics). Call model.eval() first"
        )
    return {}


# BatchNorm in eval mode: an affine map per channel, the vjp of its own forward
passthrough(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, sample_independent=True, hyperparams=_eval_only)

# the vjp of their own forward; nonlinear in the input, so DiagHessian stops there
passthrough(*(t for t in (nn.LayerNorm, _RMS_NORM) if t is not None), curved=True)
