"""jacmem: more from PyTorch's backward pass, at a fraction of the memory."""

from jacmem import memory, nn  # noqa: E402  (jacmem.memory.report/lean; jacmem.nn.Sum, Parallel, Residual, Scale)
from jacmem.context import extend, track, untrack
from jacmem.derivatives import Cost, layer, register
from jacmem.engine.secondorder.graph import ChainError
from jacmem.errors import UnsupportedCurvatureError
from jacmem.extensions.clipping import ClipGrad
from jacmem.extensions.firstorder import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from jacmem.extensions.projection import BatchGradProjection
from jacmem.extensions.secondorder import (
    EKFAC,
    GGNMP,
    HMP,
    KFAC,
    KFACEF,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)

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
    "BatchGradProjection",
    "ClipGrad",
    "DiagGGNExact",
    "DiagGGNMC",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "DiagHessian",
    "BatchDiagHessian",
    "KFAC",
    "KFACEF",
    "EKFAC",
    "KFLR",
    "KFRA",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "GGNMP",
    "HMP",
    "PCHMP",
    "ChainError",
    "UnsupportedCurvatureError",
    "UnsupportedModuleError",
    "memory",
    "nn",
]


def __getattr__(name: str):
    # made on first use (jacmem.errors): it may import Opacus
    if name == "UnsupportedModuleError":
        from jacmem.errors import unsupported_module_error

        return unsupported_module_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
