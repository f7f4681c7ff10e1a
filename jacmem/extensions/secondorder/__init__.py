"""Second-order extensions: GGN and Hessian diagonals, KFAC/KFLR/KFRA (BackPACK 1.7.1
names, attributes, shapes and scaling). The engine is :mod:`.backprop`."""

from jacmem.extensions.secondorder.base import SecondOrderExtension
from jacmem.extensions.secondorder.diag_ggn import BatchDiagGGNExact, BatchDiagGGNMC, DiagGGNExact, DiagGGNMC
from jacmem.extensions.secondorder.diag_hessian import BatchDiagHessian, DiagHessian
from jacmem.extensions.secondorder.kfac import KFAC, KFLR, KFRA

__all__ = [
    "SecondOrderExtension",
    "DiagGGNExact",
    "DiagGGNMC",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "DiagHessian",
    "BatchDiagHessian",
    "KFAC",
    "KFLR",
    "KFRA",
]
