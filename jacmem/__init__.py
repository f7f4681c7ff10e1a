"""jacmem: more from PyTorch's backward pass, at a fraction of the memory."""

from jacmem.context import extend, track, untrack
from jacmem.derivatives import Cost, layer, register
from jacmem.extensions.firstorder import BatchGrad, BatchL2Grad, SumGradSquared, Variance

__all__ = [
    "extend",
    "track",
    "untrack",
    "register",
    "layer",
    "Cost",
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
]
