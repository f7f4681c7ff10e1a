"""The mixed-precision tests' own reference (tests/engine/test_autocast.py, test_cuda.py):
each Linear and Conv2d layer's input and output gradient as an autocast pass had them,
and the per-sample gradients computed from them in float64."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.grad import conv2d_weight

#: quantities computed in float32 agree with the float64 reference to this, relative to
#: the largest entry; computed in 16 bits they would be off by ~1e-3
FLOAT32_RTOL = 1e-5


class Capture:
    """Every trainable layer's input and output gradient, as the pass had them."""

    def __init__(self, model):
        self.x, self.g, self.handles = {}, {}, []
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                self.handles.append(m.register_forward_hook(self._forward))

    def _forward(self, module, args, out):
        self.x[module] = args[0].detach()
        out.register_hook(lambda g: self.g.__setitem__(module, g))

    def remove(self):
        for h in self.handles:
            h.remove()


def per_sample(module, x, g):
    """float64 per-sample gradients of one layer from its input and output gradient."""
    x, g = x.double(), g.double()
    if isinstance(module, nn.Linear):
        return {module.weight: torch.einsum("no,ni->noi", g, x), module.bias: g}
    weight = torch.stack([
        conv2d_weight(x[n : n + 1], module.weight.shape, g[n : n + 1], module.stride, module.padding,
                      module.dilation, module.groups)
        for n in range(x.shape[0])
    ])  # fmt: skip
    return {module.weight: weight, module.bias: g.sum((2, 3))}
