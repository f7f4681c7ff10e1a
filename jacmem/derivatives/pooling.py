"""Max, average and adaptive-average pooling, 1d/2d/3d, for second-order extensions.

Their input Jacobians are those of the modules' own ``forward`` (the generic vjp of
:mod:`jacmem.derivatives.jacobians`, vmapped over ``V``); all are piecewise linear.
Average pooling's Jacobian does not depend on the sample, max pooling's does.
"""

from __future__ import annotations

from torch import nn

from jacmem.derivatives.jacobians import passthrough

passthrough(nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
passthrough(
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    sample_independent=True,
)
