"""Max, average and adaptive-average pooling, 1d/2d/3d, for second-order extensions.

Max pooling routes each output entry back to the input entry it took: one scatter
for all ``V`` vectors, with the indices of one recomputation. Average pooling's input
Jacobian is that of the module's own ``forward`` (the generic vjp of
:mod:`jacmem.derivatives.jacobians`, vmapped over ``V``). All are piecewise linear;
average pooling's Jacobian does not depend on the sample, max pooling's does.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F

from jacmem.derivatives.registry import passthrough

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _max_pool_hyperparams(module: nn.modules.pooling._MaxPoolNd) -> dict:
    return dict(
        dim=int(type(module).__name__[-2]),
        kernel_size=module.kernel_size,
        stride=module.stride,
        padding=module.padding,
        dilation=module.dilation,
        ceil_mode=module.ceil_mode,
    )


def max_pool_jac_t(xs, out, S: Tensor, *, dim: int, **hp):
    """Scatter-add of ``S`` to the positions of the maxima:
    [V, N, C, *S_out] -> ([V, N, C, *S_in],)"""
    x = xs[0]
    _, idx = _MAX_POOL[dim](x, return_indices=True, **hp)  # flat positions in each (n, c) plane
    v = S.shape[0]
    flat_idx = idx.flatten(2).unsqueeze(0).expand(v, -1, -1, -1)
    S_in = S.new_zeros((v, *x.shape[:2], x.shape[2:].numel()))
    S_in.scatter_add_(3, flat_idx, S.flatten(3))
    return (S_in.reshape(v, *x.shape),)


passthrough(nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, jac_t=max_pool_jac_t, hyperparams=_max_pool_hyperparams)
passthrough(
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    sample_independent=True,
)
